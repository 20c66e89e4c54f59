#!/usr/bin/env python3
"""From a PyTorch nn.Module to a shardd training job.

Defines a small Mixture-of-Experts language model in PyTorch (embedding; per
layer an RMSNorm, a top-k router, grouped SwiGLU experts and an optional
dense SwiGLU branch; final RMSNorm; an LM head tied to the embedding), walks
the module to write the native model spec of docs/model-spec.md, then
submits it to a running coordinator, plans it and trains a few steps on the
coordinator's workers:

    PYTHONPATH=client/python /opt/shardd/venv/bin/python \\
        client/python/examples/from_torch.py \\
        --coordinator 127.0.0.1:7070 --steps 10

Only the module's structure travels: the workers initialise and train their
own shards (synthetic Markov data unless --data names a token file), so
nothing here needs a GPU or the weights. --print-spec prints the spec and
stops; --json prints one JSON object with the results instead of lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn
import torch.nn.functional as F

try:
    import shardd
except ImportError:  # Run from a checkout: the package is two levels up.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shardd


# --- The model ---------------------------------------------------------------
# Each module names the native-spec kind it maps to (`spec_kind`); the
# attribute names follow the tree conventions of docs/model-spec.md, and the
# declaration order (MoE, dense branch, then the norm) is the parameter order
# of a layer's flat buffer.

class RMSNorm(nn.Module):
    spec_kind = "norm"

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


class Router(nn.Module):
    """Scores [E, H]; each token goes to its top_k experts, weighted by the
    softmax of their scores."""

    spec_kind = "router"

    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(experts, hidden) * hidden ** -0.5)

    def forward(self, x: torch.Tensor):
        scores = x @ self.weight.t()                      # [T, E]
        top, index = scores.topk(self.top_k, dim=-1)      # [T, k]
        return F.softmax(top, dim=-1), index


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked: gate_and_up_projs [E, H, 2I] (gate and
    up halves concatenated), down_projs [E, I, H]."""

    spec_kind = "grouped_experts"
    activation = "swiglu"

    def __init__(self, hidden: int, experts: int, intermediate: int) -> None:
        super().__init__()
        self.gate_and_up_projs = nn.Parameter(
            torch.randn(experts, hidden, 2 * intermediate) * hidden ** -0.5)
        self.down_projs = nn.Parameter(
            torch.randn(experts, intermediate, hidden) * intermediate ** -0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(self.gate_and_up_projs.shape[0]):
            token, slot = (index == expert).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = (x[token] @ self.gate_and_up_projs[expert]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_projs[expert]
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
        return out


class MoE(nn.Module):
    spec_kind = "moe"

    def __init__(self, hidden: int, experts: int, top_k: int,
                 intermediate: int) -> None:
        super().__init__()
        self.gate = Router(hidden, experts, top_k)
        self.experts = GroupedExperts(hidden, experts, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x)
        return self.experts(x, weights, index)


class DenseMLP(nn.Module):
    spec_kind = "mlp"

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + experts(norm(x)) + dense(norm(x)): no attention, which the CPU
    workers do not compute."""

    spec_kind = "decoder_layer"

    def __init__(self, hidden: int, experts: int, top_k: int,
                 moe_intermediate: int, dense_intermediate: int,
                 eps: float) -> None:
        super().__init__()
        self.moe = MoE(hidden, experts, top_k, moe_intermediate)
        self.mlp = (DenseMLP(hidden, dense_intermediate)
                    if dense_intermediate > 0 else None)
        self.input_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.input_layernorm(x)
        y = self.moe(n.reshape(-1, n.shape[-1])).reshape(n.shape)
        if self.mlp is not None:
            y = y + self.mlp(n)
        return x + y


class Backbone(nn.Module):
    spec_kind = "generic"

    def __init__(self, vocab: int, hidden: int, layers: int, experts: int,
                 top_k: int, moe_intermediate: int, dense_intermediate: int,
                 eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, experts, top_k, moe_intermediate,
                         dense_intermediate, eps) for _ in range(layers))
        self.norm = RMSNorm(hidden, eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LMHead(nn.Linear):
    spec_kind = "lm_head"


class TinyMoeForCausalLM(nn.Module):
    spec_kind = "model"

    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2,
                 experts: int = 8, top_k: int = 2, moe_intermediate: int = 32,
                 dense_intermediate: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        self.model = Backbone(vocab, hidden, layers, experts, top_k,
                              moe_intermediate, dense_intermediate, eps)
        self.lm_head = LMHead(hidden, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # Tied.

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


# --- Module -> native spec ---------------------------------------------------

# Kinds of the torch built-ins; custom modules carry `spec_kind`.
_BUILTIN_KINDS = {nn.Embedding: "embedding", nn.ModuleList: "layer_list",
                  nn.ModuleDict: "layer_list", nn.Linear: "generic"}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
           torch.float16: "float16", torch.int32: "int32",
           torch.int64: "int64"}


def _kind(module: nn.Module) -> str:
    kind = getattr(module, "spec_kind", None)
    if kind is None:
        kind = next((k for t, k in _BUILTIN_KINDS.items()
                     if isinstance(module, t)), "generic")
    return kind


def _dtype(tensor: torch.Tensor) -> str:
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"no shardd dtype for {tensor.dtype}")
    return _DTYPES[tensor.dtype]


def native_spec(model: nn.Module, *, architecture: str = "ShardMoEForCausalLM",
                model_type: str = "shard_moe") -> Dict[str, Any]:
    """The native JSON spec (docs/model-spec.md) of `model`, as a dict.

    The tree mirrors the module tree: each module's local name, its kind
    (`spec_kind`, or the torch built-in's), its own parameters (global
    shape; dtype only when it differs from the model's; frozen when
    requires_grad is off) and its children, in declaration order. A
    parameter seen before under another name (a tied LM head) gets
    `tied_to` naming the first. The dims come from the modules: vocabulary
    and hidden size from the embedding, the layer count from the layer list,
    experts, intermediate size and activation from the first grouped
    experts, top-k from the first router, the dense branch from the first
    dense MLP, the norm epsilon from the first RMSNorm.
    """
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters")
    # The most common dtype is the spec's default.
    counts: Dict[str, int] = {}
    for p in params:
        counts[_dtype(p)] = counts.get(_dtype(p), 0) + p.numel()
    default_dtype = max(counts, key=counts.get)

    owners: Dict[int, str] = {}  # id(parameter) -> its first qualified name.

    def walk(module: nn.Module, name: str, prefix: str) -> Dict[str, Any]:
        node: Dict[str, Any] = {}
        if name:
            node["name"] = name
        node["kind"] = _kind(module)
        own = []
        for local, p in module.named_parameters(recurse=False):
            qualified = f"{prefix}{local}"
            entry: Dict[str, Any] = {"name": local, "shape": list(p.shape)}
            if _dtype(p) != default_dtype:
                entry["dtype"] = _dtype(p)
            if not p.requires_grad:
                entry["frozen"] = True
            if id(p) in owners:
                entry["tied_to"] = owners[id(p)]
            else:
                owners[id(p)] = qualified
            own.append(entry)
        if own:
            node["params"] = own
        children = [walk(child, child_name, f"{prefix}{child_name}.")
                    for child_name, child in module.named_children()]
        if children:
            node["children"] = children
        return node

    # named_parameters(recurse=False) lists a shared Parameter under every
    # module holding it, so the walk sees the tied head.
    root = walk(model, "", "")

    modules = list(model.modules())

    def first(kind: str) -> Optional[nn.Module]:
        return next((m for m in modules if _kind(m) == kind), None)

    dims: Dict[str, Any] = {}
    embedding = first("embedding")
    if embedding is not None:
        dims["vocab_size"], dims["hidden_size"] = embedding.weight.shape
    layer_list = first("layer_list")
    if layer_list is not None:
        dims["num_layers"] = len(layer_list)
    experts = first("grouped_experts")
    if experts is not None:
        e, _, two_i = experts.gate_and_up_projs.shape
        dims["num_experts"] = e
        dims["top_k"] = first("router").top_k
        dims["moe_intermediate_size"] = two_i // 2
    mlp = first("mlp")
    if mlp is not None:
        dims["dense_intermediate_size"] = mlp.gate_proj.out_features
    if experts is not None or mlp is not None:
        dims["activation"] = getattr(experts or mlp, "activation", "swiglu")
    head = first("lm_head")
    if embedding is not None and head is not None:
        dims["tie_word_embeddings"] = head.weight is embedding.weight
    norm = first("norm")
    if norm is not None:
        dims["rms_norm_eps"] = norm.eps
    return {"architecture": architecture, "model_type": model_type,
            "dtype": default_dtype, "dims": dims, "root": root}


def unique_parameters(model: nn.Module) -> int:
    """Parameters counted once however many modules share them."""
    return sum(p.numel() for p in model.parameters())


# --- Submit, plan, train -----------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", help="host:port of the coordinator")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="token file on the workers")
    parser.add_argument("--dp", type=int, help="ranks (default: live workers)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dense-intermediate", type=int, default=32,
                        help="dense branch size; 0: no dense branch")
    parser.add_argument("--tls-ca")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--token-file")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--print-spec", action="store_true",
                        help="print the spec and exit (no coordinator needed)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    module = TinyMoeForCausalLM(vocab=args.vocab, hidden=args.hidden,
                                layers=args.layers, experts=args.experts,
                                top_k=args.top_k,
                                dense_intermediate=args.dense_intermediate)
    # One forward pass on the torch side: the module is a working model.
    with torch.no_grad():
        logits = module(torch.randint(0, args.vocab, (2, 8)))
    assert logits.shape == (2, 8, args.vocab)
    spec = native_spec(module)
    if args.print_spec:
        print(json.dumps(spec, indent=1))
        return 0
    if not args.coordinator:
        parser.error("--coordinator is required (or --print-spec)")

    log = (lambda *a: None) if args.json else print
    try:
        with shardd.Coordinator(args.coordinator, tls_ca=args.tls_ca,
                                tls_cert=args.tls_cert, tls_key=args.tls_key,
                                token_file=args.token_file,
                                timeout=args.timeout) as coordinator:
            dp = args.dp or coordinator.live_workers()
            submitted = coordinator.submit_model(spec, name="from_torch", dp=dp)
            torch_params = unique_parameters(module)
            log(f"model {submitted.model_id}: {submitted.summary.total_params} "
                f"parameters (torch counts {torch_params}), "
                f"{submitted.summary.expert_params} in experts")
            if submitted.summary.total_params != torch_params:
                print("error: the coordinator counts "
                      f"{submitted.summary.total_params} parameters, torch "
                      f"{torch_params}", file=sys.stderr)
                return 1
            plan = coordinator.plan(submitted.model_id)
            peak = plan.memory.peak_unsharded_bytes
            log(f"plan: strategy {plan.strategy}, {len(plan.units)} units over "
                f"{plan.world_size} ranks, {plan.memory.sharded_param_bytes} "
                f"sharded parameter bytes and a peak of {peak} unsharded "
                "bytes per rank")
            job = coordinator.train(
                submitted.model_id, steps=args.steps,
                global_batch=args.global_batch, seq_len=args.seq, lr=args.lr,
                seed=args.seed, data_path=args.data)
            log(f"job {job.job_id} on {job.world_size} workers")
            losses = []
            for event in job.events():
                losses.append(event.loss)
                log(f"step {event.step}/{event.total_steps}: loss "
                    f"{event.loss:.4f}, {event.tokens_per_second:.0f} tokens/s")
    except shardd.ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not all(math.isfinite(loss) for loss in losses):
        print(f"error: non-finite loss in {losses}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({
            "model_id": submitted.model_id, "job_id": job.job_id,
            "total_params": submitted.summary.total_params,
            "torch_params": torch_params, "strategy": plan.strategy,
            "units": len(plan.units), "world_size": job.world_size,
            "peak_unsharded_bytes": peak, "losses": losses}))
    else:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
