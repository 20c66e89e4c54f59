#!/usr/bin/env python3
"""Grouped-expert forward + backward with torch._grouped_mm (bf16).

The PyTorch counterpart of bench/grouped_experts_cuda_bench.cc: the same
expert shapes, tokens, uniform random top-k routing, FLOP count and table
columns, so the two can be compared on one GPU:

    python3 bench/torch_grouped_mm.py [--iters 20] [--warmup 5]
        [--tokens 4096,16384,65536] [--activation swiglu|geglu]

The block is the same NeMo GroupedExperts computation: a stable sort of the
T*K assignments by expert, gather, h = xs @ W_gu[e] (torch._grouped_mm with
int32 end offsets), act(gate) * up * routing weight, o = a @ W_d[e], and a
sum of each token's K rows. Differences to keep in mind when comparing:
  * the weights are stored [E, N, K] and passed as transposed views (the
    layout torch._grouped_mm's Hopper kernels take, as in torchtitan);
  * weight gradients come out in bf16 (the parameter dtype), where the
    shardd op accumulates them into fp32 buffers;
  * routing offsets stay on the device, but torch.bincount and autograd may
    synchronize on their own.

FLOPs: forward 2*T*K*D*2I + 2*T*K*I*D, backward twice the forward.
Needs PyTorch with torch._grouped_mm (2.8 or newer) and an sm_90 GPU.
"""

import argparse
import statistics
import sys

MODELS = [
    # name, experts, hidden (D), intermediate (I), top_k
    ("Qwen3-30B-A3B", 128, 2048, 768, 8),
    ("DiffusionGemma", 128, 2816, 704, 8),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokens", default="4096,16384,65536")
    parser.add_argument("--activation", choices=["swiglu", "geglu"],
                        default="swiglu")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.iters < 1 or args.warmup < 0 or any(t < 1 for t in args.tokens):
        parser.error("--iters >= 1, --warmup >= 0 and tokens >= 1 required")
    return args


def grouped_experts(torch, x, indices, weights, w_gu_t, w_d_t, activation):
    """y[T, D] for x[T, D], indices/weights [T, K], w_gu_t [E, 2I, D],
    w_d_t [E, D, I]."""
    f = torch.nn.functional
    num_experts, two_inter, _ = w_gu_t.shape
    inter = two_inter // 2
    top_k = indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # ties keep (token, k) order
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // top_k
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, w_gu_t.transpose(-2, -1), offs=offsets)
    gate, up = h[:, :inter], h[:, inter:]
    if activation == "swiglu":
        act = f.silu(gate)
    else:
        act = f.gelu(gate, approximate="tanh")
    row_weight = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    a = act * up * row_weight.to(h.dtype)
    o = torch._grouped_mm(a, w_d_t.transpose(-2, -1), offs=offsets)
    return torch.zeros_like(x).index_add_(0, token, o)


def run_model(torch, model, tokens, args):
    name, experts, dim, inter, top_k = model
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1234)
    x = torch.empty(tokens, dim, device=dev, dtype=bf16).uniform_(
        -1, 1, generator=gen).requires_grad_()
    dy = torch.empty(tokens, dim, device=dev, dtype=bf16).uniform_(
        -1, 1, generator=gen)
    w_gu_t = (torch.empty(experts, 2 * inter, dim, device=dev, dtype=bf16)
              .uniform_(-1 / 32, 1 / 32, generator=gen).requires_grad_())
    w_d_t = (torch.empty(experts, dim, inter, device=dev, dtype=bf16)
             .uniform_(-1 / 32, 1 / 32, generator=gen).requires_grad_())
    # Uniform random routing: K distinct experts per token.
    scores = torch.rand(tokens, experts, device=dev, generator=gen)
    indices = scores.topk(top_k, dim=1).indices.to(torch.int64)
    weights = (torch.rand(tokens, top_k, device=dev, generator=gen) /
               top_k).requires_grad_()

    start = torch.cuda.Event(enable_timing=True)
    mid = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    fwd, bwd, total = [], [], []
    for it in range(args.warmup + args.iters):
        for p in (x, w_gu_t, w_d_t, weights):
            p.grad = None
        start.record()
        y = grouped_experts(torch, x, indices, weights, w_gu_t, w_d_t,
                            args.activation)
        mid.record()
        y.backward(dy)
        end.record()
        end.synchronize()
        if it < args.warmup:
            continue
        f_ms = start.elapsed_time(mid)
        b_ms = mid.elapsed_time(end)
        fwd.append(f_ms)
        bwd.append(b_ms)
        total.append(f_ms + b_ms)

    fwd_flops = 6.0 * tokens * top_k * dim * inter
    f_ms, b_ms, t_ms = (statistics.median(v) for v in (fwd, bwd, total))
    print(f"{name:<16} {tokens:7d} {'torch._grouped_mm':<18} {f_ms:9.3f} "
          f"{b_ms:9.3f} {t_ms:9.3f} {fwd_flops / (f_ms * 1e9):9.1f} "
          f"{2 * fwd_flops / (b_ms * 1e9):9.1f} "
          f"{3 * fwd_flops / (t_ms * 1e9):9.1f}", flush=True)


def main():
    args = parse_args()
    try:
        import torch
    except ImportError:
        print("torch_grouped_mm.py: PyTorch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("torch_grouped_mm.py: no GPU; nothing to measure",
              file=sys.stderr)
        return 1
    if not hasattr(torch, "_grouped_mm"):
        print(f"torch_grouped_mm.py: torch {torch.__version__} has no "
              "torch._grouped_mm (needs 2.8 or newer)", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} (sm_{props.major}{props.minor}), torch "
          f"{torch.__version__}, bf16, median of {args.iters} after "
          f"{args.warmup} warmup, {args.activation}")
    print(f"{'model':<16} {'tokens':>7} {'path':<18} {'fwd_ms':>9} "
          f"{'bwd_ms':>9} {'total_ms':>9} {'fwd_TF/s':>9} {'bwd_TF/s':>9} "
          f"{'total_TF/s':>9}")
    for model in MODELS:
        for tokens in args.tokens:
            run_model(torch, model, tokens, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
