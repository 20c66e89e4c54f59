"""shardd's first AdamW steps, started from Hugging Face safetensors, against
PyTorch.

For each tiny config: model_dump draws random fp32 weights (shardd names),
this test writes them as a Hugging Face checkpoint under the published
tensor names and layouts (per-expert Linear weights for Mixtral and
Qwen3-MoE, GPT-OSS's fused interleaved experts; one file or an index with
shards; F32, BF16 or F16) plus a uint16 token file. A coordinator and four
CPU workers on loopback then train 3 steps with `shardctl train --init-from
--data-order strided --json` at 1, 2 and 4 workers under every strategy
that applies (and HSDP, 2 shards x 2 replicas), and the losses and gradient
norms of the 3 steps are compared with hf_reference_test.py's float64
forward, autograd and
torch.optim.AdamW with the same hyper-parameters. Then the checkpoint
saved after step 3 goes through `shardctl checkpoint export --hf OUT`, and a
job started with `--model OUT --init-from OUT` must see the loss the
reference has after its 3 updates.

Usage: train_reference_test.py BIN_DIR MODEL_DUMP CONFIG.json [...]
  BIN_DIR holds server/shardd-coordinator, worker/shardd-worker and
  client/shardctl (bazel-bin's layout).
"""

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference_test import forward  # noqa: E402

torch.set_default_dtype(torch.float64)

WORKERS = 4
BATCH, SEQ, STEPS = 4, 16, 3
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1

# fp32 (--no-mixed-precision) against float64: the 1e-5 relative.
# Rounding errors of the fp32 forward and backward are independent across
# the ~L = 40 chained operations of n <= 128 terms each (see
# hf_reference_test.py), so they grow like sqrt(L n) u = 72 * 2^-24 = 4.3e-6
# rather than the worst case L n u; AdamW's first steps move each weight by
# about lr * sign(g) whatever the rounding, except where |g| is within
# rounding of 0, whose contribution to the loss is second order.
FP32_BOUND = 1e-5
# Mixed precision (bf16 gather and compute, fp32 master and reduce): every
# weight and stored activation is rounded to bf16 (relative error at most
# u = 2^-9) about R = 12 times on a path through one layer (weights of the
# norms, projections, router and experts; the normed input, attention
# output, expert activations), R = 2 * 12 + 3 for the two layers, embedding
# and head. First order, step 1's loss and gradient norm (same weights) move
# by at most R * u = 27 * 2^-9 = 5.3e-2 relative. After that the weights
# differ: AdamW's first updates are about lr * sign(g), so a gradient
# element i whose rounding error e_i exceeds |g_i| may move the other way,
# a weight change of 2 lr where |g_i| <= |e_i|; the loss then moves by at
# most sum_i |g_i| 2 lr <= 2 lr R u |g|_1 per earlier step (first order).
# Later gradient norms also move through the curvature, which has no such
# bound, so in bf16 only step 1's gradient norm is compared.
BF16_BOUND = 27 * 2.0 ** -9


def write_safetensors(path, tensors):
    """tensors: name -> (dtype tag, torch tensor of that dtype)."""
    header, blobs, offset = {}, [], 0
    for name, (tag, t) in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": tag, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def hf_layout(params, architecture, inter_of):
    """shardd names and layouts -> Hugging Face's, as published."""
    out = {}
    for name, w in params.items():
        m = re.match(r"(model\.layers\.\d+\.)moe\.(.*)", name)
        if not m:
            out[name] = w
            continue
        pre, rest = m.groups()
        if architecture == "GptOssForCausalLM":
            if rest in ("experts.gate_and_up_projs", "experts.gate_up_proj_bias"):
                i = w.shape[-1] // 2
                fused = torch.stack((w[..., :i], w[..., i:]), dim=-1).flatten(-2)
                key = "gate_up_proj" if rest.endswith("projs") else "gate_up_proj_bias"
                out[pre + "mlp.experts." + key] = fused
            elif rest == "experts.down_projs":
                out[pre + "mlp.experts.down_proj"] = w
            elif rest.startswith("gate."):
                out[pre + "mlp.router." + rest[len("gate."):]] = w
            else:
                out[pre + "mlp." + rest] = w
            continue
        mixtral = architecture == "MixtralForCausalLM"
        module = "block_sparse_moe" if mixtral else "mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        if rest == "experts.gate_and_up_projs":  # [E, D, 2I]
            i = inter_of[pre]
            for e in range(w.shape[0]):
                out[f"{pre}{module}.experts.{e}.{names[0]}.weight"] = w[e, :, :i].T
                out[f"{pre}{module}.experts.{e}.{names[1]}.weight"] = w[e, :, i:].T
        elif rest == "experts.down_projs":  # [E, I, D]
            for e in range(w.shape[0]):
                out[f"{pre}{module}.experts.{e}.{names[2]}.weight"] = w[e].T
        else:
            out[pre + module + "." + rest] = w
    return out


def save_hf(directory, params, architecture, dtype, shards):
    """Writes params (shardd names, float64) as an HF checkpoint in `dtype`;
    returns the float64 values the checkpoint holds, under shardd names."""
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16,
                   "F16": torch.float16}[dtype]
    stored = {n: w.to(torch_dtype) for n, w in params.items()}
    inter_of = {}
    for n, w in params.items():
        m = re.match(r"(model\.layers\.\d+\.)moe\.experts\.down_projs", n)
        if m:
            inter_of[m.group(1)] = w.shape[1]
    hf = hf_layout(stored, architecture, inter_of)
    names = sorted(hf)
    groups = [names[k::shards] for k in range(shards)]
    os.makedirs(directory, exist_ok=True)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"),
                          {n: (dtype, hf[n]) for n in names})
    else:
        weight_map = {}
        for k, group in enumerate(groups):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(os.path.join(directory, file),
                              {n: (dtype, hf[n]) for n in group})
            weight_map.update({n: file for n in group})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    total_bytes = sum(hf[n].numel() * hf[n].element_size() for n in names)
    return {n: w.to(torch.float64) for n, w in stored.items()}, total_bytes


def reference(architecture, dims, params, tokens):
    """(loss, grad_norm, |grad|_1) of each step: float64 forward and
    autograd, then torch.optim.AdamW, on the strided windows the workers
    read; one more entry, without its update, for the weights after
    STEPS updates (on the first step's batch again, as a job started from
    them reads it)."""
    # DeepSeek-V3's e_score_correction_bias is a buffer in HF and frozen in
    # shardd: no gradient, no update, not in the gradient norm.
    p = {n: w.clone().requires_grad_(not n.endswith("e_score_correction_bias"))
         for n, w in params.items()}
    trainable = [w for w in p.values() if w.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(STEPS + 1):
        # Step s reads sequences [s B, (s + 1) B); sequence k is the window
        # of SEQ + 1 tokens at k * SEQ (worker/data/token_file.h, strided).
        first = (step % STEPS) * BATCH
        rows = [tokens[k * SEQ: k * SEQ + SEQ + 1]
                for k in range(first, first + BATCH)]
        batch = {"architecture": architecture, "dims": dims,
                 "batch": BATCH, "seq": SEQ,
                 "inputs": [t for r in rows for t in r[:-1]],
                 "targets": [t for r in rows for t in r[1:]]}
        opt.zero_grad()
        loss = forward(batch, p)
        loss.backward()
        norm = torch.sqrt(sum((w.grad ** 2).sum() for w in trainable))
        l1 = sum(w.grad.abs().sum() for w in trainable)
        out.append((loss.item(), norm.item(), l1.item()))
        if step < STEPS:
            opt.step()
    return out


class Cluster:
    """A coordinator and WORKERS CPU workers on loopback."""

    def __init__(self, bin_dir, work):
        self.bin, self.work, self.procs = bin_dir, work, []
        self.logs = []
        data = os.path.join(work, "coordinator")
        self.checkpoints = os.path.join(work, "checkpoints")
        self.spawn("coordinator", [f"{bin_dir}/server/shardd-coordinator",
                                   "--listen=127.0.0.1:0", f"--data-dir={data}",
                                   f"--checkpoint-dir={self.checkpoints}",
                                   f"--workers={WORKERS}"])
        port_file = os.path.join(data, "coordinator.port")
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and os.path.getsize(port_file)):
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError("the coordinator published no port in 30 s")
            time.sleep(0.1)
        with open(port_file) as f:
            self.address = f"127.0.0.1:{f.read().strip()}"
        for i in range(WORKERS):
            self.spawn(f"worker{i}", [f"{bin_dir}/worker/shardd-worker",
                                      f"--coordinator={self.address}",
                                      "--listen=127.0.0.1:0",
                                      f"--checkpoint-root={self.checkpoints}",
                                      f"--requested-rank={i}"])
        deadline = time.time() + 60
        while True:
            self.check_alive()
            status = self.shardctl(["status", "--json"], timeout=10, check=False)
            if status.returncode == 0:
                workers = json.loads(status.stdout).get("workers", [])
                if sum(1 for w in workers if w.get("alive")) >= WORKERS:
                    return
            if time.time() > deadline:
                raise RuntimeError(f"{WORKERS} workers did not register in 60 s")
            time.sleep(0.2)

    def spawn(self, name, argv):
        log = os.path.join(self.work, name + ".log")
        self.logs.append(log)
        with open(log, "wb") as err:
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                               stderr=err))

    def check_alive(self):
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                with open(log, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"{log} exited {proc.returncode}:\n{tail}")

    def shardctl(self, args, timeout=120, check=True):
        argv = [f"{self.bin}/client/shardctl", args[0],
                "--coordinator", self.address] + args[1:]
        run = subprocess.run(argv, capture_output=True, text=True,
                             timeout=timeout)
        if check and run.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {run.returncode}:\n"
                               f"{run.stdout}\n{run.stderr}")
        return run

    def shardctl_local(self, args):
        """A shardctl command that needs no coordinator."""
        argv = [f"{self.bin}/client/shardctl"] + args
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {run.returncode}:\n"
                               f"{run.stdout}\n{run.stderr}")
        return run

    def worker_log_sizes(self):
        return [os.path.getsize(log) for log in self.logs[1:]]

    def bytes_read_since(self, sizes):
        """Tensor bytes the workers logged reading from --init-from."""
        total = 0
        for log, start in zip(self.logs[1:], sizes):
            with open(log, errors="replace") as f:
                f.seek(start)
                for m in re.finditer(r"initialised its shards from \S+ \((\d+) bytes",
                                     f.read()):
                    total += int(m.group(1))
        return total

    def stop(self):
        for proc in reversed(self.procs):  # Workers first.
            if proc.poll() is None:
                proc.terminate()
        deadline = time.time() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def train(cluster, config, init_from, data, world, strategy, mixed,
          steps=STEPS, extra=()):
    """(loss, grad_norm) per step, and the checkpoints the job saved."""
    args = ["train", "--model", config, "--init-from", init_from,
            "--data", data, "--data-order", "strided", "--steps", str(steps),
            "--global-batch", str(BATCH), "--seq", str(SEQ), "--lr", str(LR),
            "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
            "--eps", str(EPS), "--weight-decay", str(WEIGHT_DECAY),
            "--grad-clip", "0", "--dp", str(world), "--strategy", strategy,
            "--json"]
    if not mixed:
        args.append("--no-mixed-precision")
    run = cluster.shardctl(args + list(extra))
    lines = [json.loads(line) for line in run.stdout.splitlines()
             if line.startswith('{"event":"step"')]
    if [s["step"] for s in lines] != list(range(1, steps + 1)):
        raise RuntimeError(f"expected {steps} step lines:\n{run.stdout}")
    return ([(s["loss"], s["grad_norm"]) for s in lines],
            [s["checkpoint"] for s in lines if "checkpoint" in s])


# Which HF layout each config is written in: (dtype, files).
STORAGE = {
    "tiny_llama3.json": ("F32", 1),
    "tiny_mixtral.json": ("F32", 3),
    "tiny_qwen3_moe.json": ("BF16", 2),
    "tiny_qwen3_moe_unnormalized.json": ("F16", 1),
    "tiny_gpt_oss.json": ("F32", 1),
}


def main():
    bin_dir, dump_binary, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
    failures, checks, worst_fp32, worst_bf16 = 0, 0, 0.0, 0.0
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(bin_dir, work)
        try:
            for config in configs:
                name = os.path.basename(config)
                with open(config) as f:
                    architecture = json.load(f)["architectures"][0]
                dump_path = os.path.join(work, name + ".dump.json")
                extra = (["--gate_up_scale=6"]
                         if architecture == "GptOssForCausalLM" else [])
                subprocess.run([dump_binary, f"--model={config}", "--batch=1",
                                "--seq=2", "--seed=11", f"--out={dump_path}"]
                               + extra, check=True, timeout=120)
                with open(dump_path) as f:
                    dump = json.load(f)
                params = {n: torch.tensor(t["values"]).view(t["shape"])
                          for n, t in dump["params"].items()}
                dtype, files = STORAGE.get(name, ("F32", 1))
                hf_dir = os.path.join(work, name + ".hf")
                params, total_bytes = save_hf(hf_dir, params, architecture,
                                              dtype, files)
                vocab = int(dump["dims"]["vocab_size"])
                gen = torch.Generator().manual_seed(5)
                tokens = torch.randint(0, vocab, (STEPS * BATCH * SEQ + 1,),
                                       generator=gen).tolist()
                data = os.path.join(work, name + ".bin")
                with open(data, "wb") as f:
                    f.write(struct.pack(f"<{len(tokens)}H", *tokens))
                want = reference(dump["architecture"], dump["dims"], params,
                                 tokens)
                print(f"{name} ({architecture}, {dtype} in {files} file(s)): "
                      "reference losses " +
                      ", ".join(f"{w[0]:.9f}" for w in want))
                moe = any(".moe.experts." in n for n in params)
                strategies = ["default", "megatron_fsdp"] + (
                    ["diffusion_gemma"] if moe else [])
                # (dp, replicas, strategy, mixed precision): every strategy
                # at 1, 2 and 4 ranks, HSDP 2 x 2, and bf16 at 2 ranks.
                runs = [(w, 1, s, False) for w in (1, 2, 4) for s in strategies]
                runs += [(2, 2, "default", False), (2, 1, "default", True)]
                for world, replicas, strategy, mixed in runs:
                    sizes = cluster.worker_log_sizes()
                    got, _ = train(cluster, config, hf_dir, data, world,
                                   strategy, mixed,
                                   extra=["--replicate", str(replicas)])
                    bound = BF16_BOUND if mixed else FP32_BOUND
                    # Errors relative to each check's own bound.
                    errs, ratios, flips = [], [], 0.0
                    for step, ((gl, gn), (wl, wn, l1)) in enumerate(zip(got, want)):
                        loss_bound = bound + (flips / abs(wl) if mixed else 0)
                        errs.append(abs(gl - wl) / abs(wl))
                        ratios.append(errs[-1] / loss_bound)
                        if step == 0 or not mixed:
                            errs.append(abs(gn - wn) / abs(wn))
                            ratios.append(errs[-1] / bound)
                        flips += 2 * LR * BF16_BOUND * l1
                    worst, ratio = max(errs), max(ratios)
                    checks += 1
                    if mixed:
                        worst_bf16 = max(worst_bf16, worst)
                    else:
                        worst_fp32 = max(worst_fp32, worst)
                    read = cluster.bytes_read_since(sizes)
                    # Every element is owned by one rank of a replica: each
                    # replica reads the checkpoint's bytes exactly once
                    # (GPT-OSS's interleaved rows may be read whole at a
                    # range's ends).
                    exact = architecture != "GptOssForCausalLM"
                    want_read = total_bytes * replicas
                    read_ok = read == want_read if exact else read >= want_read
                    status = "ok" if ratio <= 1 and read_ok else "FAIL"
                    if status == "FAIL":
                        failures += 1
                    mesh = f"{world}" if replicas == 1 else f"{world}x{replicas}"
                    print(f"  {status} {mesh} worker(s) {strategy:14s} "
                          f"{'bf16' if mixed else 'fp32'}: largest relative "
                          f"error {worst:.2e}, {ratio:.2f} of its bound "
                          f"({bound:.1e}{' + the update term' if mixed else ''}); "
                          f"{read} bytes read ({replicas} x {total_bytes} wanted)")
                    if status == "FAIL":
                        print("    shardd", got, "\n    reference", want)
                # Export the state after 3 steps and start from it.
                _, saved = train(cluster, config, hf_dir, data, 2, "default",
                                 False, extra=["--checkpoint-every", str(STEPS)])
                out = os.path.join(work, name + ".export")
                cluster.shardctl_local(["checkpoint", "export", "--checkpoint",
                                        os.path.join(cluster.checkpoints, saved[-1]),
                                        "--hf", out])
                resumed, _ = train(cluster, out, out, data, 1, "default", False,
                                   steps=1)
                err = abs(resumed[0][0] - want[STEPS][0]) / abs(want[STEPS][0])
                checks += 1
                worst_fp32 = max(worst_fp32, err)
                status = "ok" if err <= FP32_BOUND else "FAIL"
                failures += status == "FAIL"
                print(f"  {status} checkpoint export --hf, then --init-from it: "
                      f"loss {resumed[0][0]:.9f} vs the reference's after "
                      f"{STEPS} updates {want[STEPS][0]:.9f} (relative {err:.2e})")
        finally:
            cluster.stop()
    print(f"{checks} runs: largest fp32 error {worst_fp32:.2e}, bf16 "
          f"{worst_bf16:.2e}; {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
