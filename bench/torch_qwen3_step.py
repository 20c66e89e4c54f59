#!/usr/bin/env python3
"""Tokens/s of a plain-PyTorch Qwen3-MoE training step, CPU or one GPU.

The PyTorch side of bench/gpu_vs_fsdp2.sh (the CPU comparison,
bench/cpu_vs_torch.sh, runs transformers' own model: bench/torch2_step.py):
the model of a Hugging Face Qwen3-MoE config.json written as Hugging Face
defines it, AdamW
with gradient clipping at 1.0, random tokens, the given batch. Prints the
median step time and tokens/s after warm-up.

    /usr/bin/python3 bench/torch_qwen3_step.py CONFIG.json --batch B --seq S
        --threads N [--steps 8] [--warmup 2]
    python3 bench/torch_qwen3_step.py CONFIG.json --batch B --seq S
        --device cuda --fsdp2

CPU: fp32, eager attention and the MoE computed per expert on the tokens
routed to it (Hugging Face's own loop). --device cuda: the fast paths
PyTorch has there, so the baseline is a strong one: scaled_dot_product_
attention (flash, GQA) and torch._grouped_mm over the tokens sorted by
expert (NeMo AutoModel's GroupedExperts). --fsdp2 wraps every decoder layer
and the root in FSDP2's fully_shard (world size 1, NCCL) with bf16
parameters and compute and fp32 gradient reduction, shardd's default mixed
precision; the master weights and AdamW stay fp32.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Layer(torch.nn.Module):
    """One decoder layer: attention, then the routed experts (no dense MLP:
    Qwen3-MoE with decoder_sparse_step 1). A module of its own, so FSDP2's
    fully_shard gathers its parameters around its forward."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        d, hd = c["hidden_size"], c["head_dim"]
        hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
        e, inter = c["num_experts"], c["moe_intermediate_size"]
        p = torch.nn.Parameter
        r = lambda *s: p(torch.randn(*s) * 0.02)
        self.n1, self.n2 = p(torch.ones(d)), p(torch.ones(d))
        self.wq, self.wk = r(hq * hd, d), r(hkv * hd, d)
        self.wv, self.wo = r(hkv * hd, d), r(d, hq * hd)
        self.qn, self.kn = p(torch.ones(hd)), p(torch.ones(hd))
        self.gate = r(e, d)
        # [E, N, K]: each expert's Linear weight, the layout
        # torch._grouped_mm's Hopper kernels take transposed.
        self.w_gu = r(e, 2 * inter, d)
        self.w_d = r(e, d, inter)

    def attention(self, q, k, v, mask):
        hq, hkv = q.shape[1], k.shape[1]
        if hasattr(F, "scaled_dot_product_attention") and q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=hq != hkv)
        # Hugging Face's eager attention (Debian's torch 1.13 has no
        # scaled_dot_product_attention).
        scores = q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2)
        scores = scores * q.shape[-1] ** -0.5 + mask
        return torch.softmax(scores, dim=-1) @ v.repeat_interleave(hq // hkv, 1)

    def experts(self, h, w, idx):
        inter = self.w_d.shape[2]
        if hasattr(torch, "_grouped_mm") and h.is_cuda:
            # Sorted by expert, one grouped GEMM per projection, int32 end
            # offsets (no host synchronisation).
            order = torch.argsort(idx.view(-1), stable=True)
            counts = torch.bincount(idx.view(-1), minlength=self.gate.shape[0])
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            token = order // idx.shape[1]
            xs = h.index_select(0, token)
            gu = torch._grouped_mm(xs, self.w_gu.transpose(-2, -1),
                                   offs=offsets)
            a = F.silu(gu[:, :inter]) * gu[:, inter:]
            a = a * w.view(-1).index_select(0, order).unsqueeze(1).to(a.dtype)
            o = torch._grouped_mm(a, self.w_d.transpose(-2, -1), offs=offsets)
            return torch.zeros_like(h).index_add_(0, token, o)
        out = torch.zeros_like(h)
        for e in range(self.gate.shape[0]):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gu = h[rows] @ self.w_gu[e].T
            a = F.silu(gu[:, :inter]) * gu[:, inter:]
            out = out.index_add(0, rows,
                                (a @ self.w_d[e].T) * w[rows, slot, None])
        return out

    def forward(self, x, cos, sin, mask):
        c = self.c
        b, s, _ = x.shape
        hq, hkv, hd = (c["num_attention_heads"], c["num_key_value_heads"],
                       c["head_dim"])
        eps, k = c["rms_norm_eps"], c["num_experts_per_tok"]
        h = rms_norm(x, self.n1, eps)
        q = rms_norm((h @ self.wq.T).view(b, s, hq, hd), self.qn, eps)
        kk = rms_norm((h @ self.wk.T).view(b, s, hkv, hd), self.kn, eps)
        q, kk = q.transpose(1, 2), kk.transpose(1, 2)
        v = (h @ self.wv.T).view(b, s, hkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        kk = kk * cos + rotate_half(kk) * sin
        o = self.attention(q, kk, v, mask)
        x = x + o.transpose(1, 2).reshape(b, s, hq * hd) @ self.wo.T
        h = rms_norm(x, self.n2, eps).view(b * s, -1)
        probs = torch.softmax((h @ self.gate.T).float(), dim=-1)
        w, idx = torch.topk(probs, k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return x + self.experts(h, w, idx).view(b, s, -1)


class Model(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, hd = c["hidden_size"], c["head_dim"]
        r = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.02)
        self.embed = r(c["vocab_size"], d)
        self.layers = torch.nn.ModuleList(
            Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = torch.nn.Parameter(torch.ones(d))
        self.head = r(c["vocab_size"], d)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2) / hd))
        self.register_buffer("inv_freq", inv.float())

    def forward(self, tokens, targets):
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        x = self.embed[tokens]
        # In the compute dtype (bf16 under FSDP2's mixed precision).
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = rms_norm(x, self.norm, self.c["rms_norm_eps"]) @ self.head.T
        return F.cross_entropy(logits.view(b * s, -1).float(), targets.view(-1))


def wrap_fsdp2(model):
    """fully_shard on every decoder layer, then the root (world size 1)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fsdp2", action="store_true",
                    help="FSDP2 fully_shard, bf16 mixed precision (cuda)")
    args = ap.parse_args()
    if args.fsdp2 and args.device != "cuda":
        ap.error("--fsdp2 needs --device cuda")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(args.config) as f:
        config = json.load(f)
    device = torch.device(args.device)
    model = Model(config).to(device)
    if args.fsdp2:
        model = wrap_fsdp2(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq),
                               device=device)
        targets = torch.randint(0, config["vocab_size"], (args.batch, args.seq),
                                device=device)
        sync()
        start = time.perf_counter()
        loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    t = statistics.median(times)
    where = (f"{args.threads} threads" if args.device == "cpu" else
             f"{torch.cuda.get_device_name()}{', FSDP2' if args.fsdp2 else ''}")
    print(f"torch {torch.__version__}, {where}: step "
          f"{t * 1e3:.1f} ms, {args.batch * args.seq / t:.0f} tokens/s "
          f"(median of {args.steps}), last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
