#!/usr/bin/env python3
"""Tokens/s of Hugging Face transformers' own model training on the CPU under
PyTorch 2: the peers shardd's CPU workers are measured against
(bench/cpu_vs_torch.sh).

The architecture's class is built from a config.json (fp32, random
weights), and each step is a forward, the mean token cross-entropy, a
backward and torch.optim.AdamW (clipping off, as shardd's runs), on random
tokens of the given batch. Prints one JSON line per mode with the median
step time after warm-up:

- eager: attn_implementation="eager";
- sdpa: attn_implementation="sdpa" (scaled_dot_product_attention);
- compile: sdpa under torch.compile (the compile and its warm-up steps are
  not timed);
- fsdp2: sdpa, every decoder layer and the root wrapped in FSDP2's
  fully_shard, 2 processes over Gloo on loopback, each with half the batch
  and half the threads (fp32 throughout, shardd's --no-mixed-precision).

    python bench/torch2_step.py CONFIG.json --batch 8 --seq 256 --threads 2
        [--steps 8] [--warmup 2] [--modes eager,sdpa,compile,fsdp2]

Run it with the tests' environment (tools/python_env.sh):
/opt/shardd/venv/bin/python.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F


def build(config_path, attention):
    import transformers
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(config_path, os.path.join(d, "config.json"))
        config = transformers.AutoConfig.from_pretrained(d)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attention, dtype=torch.float32)


def timed_steps(model, batch, seq, steps, warmup, step_fn=None):
    """Median seconds per training step after `warmup` untimed steps."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1)
    forward = model if step_fn is None else step_fn

    def step():
        opt.zero_grad(set_to_none=True)
        logits = forward(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fsdp2_worker(rank, world, port, args, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        model = build(args.config, "sdpa")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        seconds = timed_steps(model, args.batch // world, args.seq,
                              args.steps, args.warmup)
        # The job's step ends when the slowest rank's does.
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(t.item()))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default="eager,sdpa,compile,fsdp2")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.batch * args.seq
    for mode in args.modes.split(","):
        if mode in ("eager", "sdpa"):
            seconds = timed_steps(build(args.config, mode), args.batch,
                                  args.seq, args.steps, args.warmup)
        elif mode == "compile":
            model = build(args.config, "sdpa")
            seconds = timed_steps(model, args.batch, args.seq, args.steps,
                                  args.warmup, torch.compile(model))
        elif mode == "fsdp2":
            import torch.multiprocessing as mp
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "seconds")
                mp.spawn(fsdp2_worker, args=(2, free_port(), args, out),
                         nprocs=2, join=True)
                with open(out) as f:
                    seconds = float(f.read())
        else:
            sys.exit(f"--modes: unknown mode {mode!r}; allowed: eager, sdpa, "
                     "compile, fsdp2")
        print(json.dumps({"mode": mode, "torch": torch.__version__,
                          "seconds_per_step": seconds,
                          "tokens_per_second": tokens / seconds}), flush=True)


if __name__ == "__main__":
    main()
