#!/usr/bin/env python3
"""Attention forward + backward with torch's scaled_dot_product_attention.

The PyTorch counterpart of bench/attention_cuda_bench.cc: the same shapes
(bf16, causal, grouped-query), FLOP count and columns, on one GPU:

    python3 bench/torch_sdpa.py [--iters 10] [--warmup 3]
"""

import argparse

import torch

SHAPES = [
    # name, batch, seq, q heads, kv heads, head dim
    ("Qwen3-30B-A3B", 1, 4096, 32, 4, 128),
    ("Llama-3-8B", 1, 4096, 32, 8, 128),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
          f" scaled_dot_product_attention, bf16, causal, median of "
          f"{args.iters} after {args.warmup} warmup")
    print(f"{'shape':16s} {'seq':>6s} {'fwd_ms':>8s} {'bwd_ms':>8s} "
          f"{'fwd_TF/s':>9s} {'bwd_TF/s':>9s}")
    for name, b, s, hq, hkv, d in SHAPES:
        q = torch.randn(b, hq, s, d, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        dout = torch.randn(b, hq, s, d, device=dev, dtype=torch.bfloat16)
        fwd, bwd = [], []
        for it in range(args.warmup + args.iters):
            a = torch.cuda.Event(enable_timing=True)
            m = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            a.record()
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)
            m.record()
            out.backward(dout)
            e.record()
            torch.cuda.synchronize()
            q.grad = k.grad = v.grad = None
            if it >= args.warmup:
                fwd.append(a.elapsed_time(m))
                bwd.append(m.elapsed_time(e))
        fwd.sort()
        bwd.sort()
        f, g = fwd[len(fwd) // 2], bwd[len(bwd) // 2]
        flops = 4.0 * b * hq * s * s * d / 2
        print(f"{name:16s} {s:6d} {f:8.3f} {g:8.3f} {flops / f / 1e9:9.2f} "
              f"{2.5 * flops / g / 1e9:9.2f}")


if __name__ == "__main__":
    main()
