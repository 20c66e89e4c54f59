#!/usr/bin/env python3
"""Tokens/s of a plain-PyTorch Qwen3-MoE training step on the CPU.

The PyTorch side of bench/cpu_vs_torch.sh: the model of a Hugging Face
Qwen3-MoE config.json written as Hugging Face defines it (the same layers as
tests/reference/hf_reference_test.py, in fp32, with the MoE computed per
expert on the tokens routed to it), AdamW, random tokens, the given batch
and threads. Prints the median step time and tokens/s after warm-up.

    /usr/bin/python3 bench/torch_qwen3_step.py CONFIG.json --batch B --seq S
        --threads N [--steps 8] [--warmup 2]
"""

import argparse
import json
import statistics
import time

import torch


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Model(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, hd = c["hidden_size"], c["head_dim"]
        hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
        e, inter = c["num_experts"], c["moe_intermediate_size"]
        p = torch.nn.Parameter
        r = lambda *s: p(torch.randn(*s) * 0.02)
        self.embed = r(c["vocab_size"], d)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = torch.nn.Module()
            layer.n1, layer.n2 = p(torch.ones(d)), p(torch.ones(d))
            layer.wq, layer.wk = r(hq * hd, d), r(hkv * hd, d)
            layer.wv, layer.wo = r(hkv * hd, d), r(d, hq * hd)
            layer.qn, layer.kn = p(torch.ones(hd)), p(torch.ones(hd))
            layer.gate = r(e, d)
            layer.w_gu = r(e, d, 2 * inter)
            layer.w_d = r(e, inter, d)
            self.layers.append(layer)
        self.norm = p(torch.ones(d))
        self.head = r(c["vocab_size"], d)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2) / hd))
        self.register_buffer("inv_freq", inv.float())

    def forward(self, tokens, targets):
        c = self.c
        b, s = tokens.shape
        hq, hkv, hd = (c["num_attention_heads"], c["num_key_value_heads"],
                       c["head_dim"])
        eps, k = c["rms_norm_eps"], c["num_experts_per_tok"]
        freqs = torch.arange(s).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((s, s), float("-inf")).triu(1)
        x = self.embed[tokens]
        for L in self.layers:
            h = rms_norm(x, L.n1, eps)
            q = rms_norm((h @ L.wq.T).view(b, s, hq, hd), L.qn, eps).transpose(1, 2)
            kk = rms_norm((h @ L.wk.T).view(b, s, hkv, hd), L.kn, eps).transpose(1, 2)
            v = (h @ L.wv.T).view(b, s, hkv, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            kk = kk * cos + rotate_half(kk) * sin
            # Hugging Face's eager attention (Debian's torch 1.13 has no
            # scaled_dot_product_attention).
            scores = q @ kk.repeat_interleave(hq // hkv, 1).transpose(-1, -2)
            scores = scores * hd ** -0.5 + mask
            o = torch.softmax(scores, dim=-1) @ v.repeat_interleave(hq // hkv, 1)
            x = x + o.transpose(1, 2).reshape(b, s, hq * hd) @ L.wo.T
            h = rms_norm(x, L.n2, eps).view(b * s, -1)
            probs = torch.softmax(h @ L.gate.T, dim=-1)
            w, idx = torch.topk(probs, k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(h)
            inter = L.w_d.shape[1]
            for e in range(L.gate.shape[0]):
                rows, slot = (idx == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                gu = h[rows] @ L.w_gu[e]
                a = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
                out = out.index_add(0, rows, (a @ L.w_d[e]) * w[rows, slot, None])
            x = x + out.view(b, s, -1)
        logits = rms_norm(x, self.norm, eps) @ self.head.T
        return torch.nn.functional.cross_entropy(
            logits.view(b * s, -1), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(args.config) as f:
        config = json.load(f)
    model = Model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq))
        targets = torch.randint(0, config["vocab_size"], (args.batch, args.seq))
        start = time.perf_counter()
        loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    t = statistics.median(times)
    print(f"torch {torch.__version__}, {args.threads} threads: step "
          f"{t * 1e3:.1f} ms, {args.batch * args.seq / t:.0f} tokens/s "
          f"(median of {args.steps})")


if __name__ == "__main__":
    main()
