"""shardd's training against Hugging Face transformers itself.

For each tiny config, transformers builds the architecture's own class from
the config (fp32, eager attention), its weights are redrawn so that every
op matters (below), and `save_pretrained` writes the checkpoint in the
layout and dtype the pinned transformers writes (per-expert Linear weights
for Mixtral, Qwen3-MoE and DeepSeek-V3, GPT-OSS's fused experts; F32, BF16,
F16; one file or shards with an index). Then, on a coordinator and four CPU
workers on loopback:

- `shardctl train --model DIR --init-from DIR` trains 3 AdamW steps
  (clipping off) at 1, 2 and 4 workers under every strategy that applies,
  HSDP 2 x 2 and bf16 mixed precision at 2; each step's loss and gradient
  norm must equal those of the transformers model loaded from DIR in
  float64 (`from_pretrained`), trained with torch.optim.AdamW on the same
  batches, within the bounds of docs/testing.md. With
  `output_router_logits` the loss includes `router_aux_loss_coef` times
  the model's own `aux_loss`.
- The job's checkpoint goes through `shardctl checkpoint export --hf OUT`;
  `from_pretrained(OUT)` must report no missing, unexpected or mismatched
  keys, OUT must hold exactly DIR's tensor names and shapes (the published
  layout), and its logits on a held-out batch must equal those of the
  reference model after the same 3 updates.
- Each comparison can fail: the step-1 check is repeated against a
  deliberately wrong oracle (softmax scale, RoPE pairing, router
  renormalisation, each patched into transformers' own module), which must
  fall outside the bound.

Usage: transformers_test.py BIN_DIR CONFIG.json [...]
  BIN_DIR holds server/shardd-coordinator, worker/shardd-worker and
  client/shardctl (bazel-bin's layout).
"""

import contextlib
import json
import os
import struct
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardd_cluster import (BATCH, BETAS, EPS, LR, SEQ, STEPS,  # noqa: E402
                            WEIGHT_DECAY, Cluster, train)

# fp32 (--no-mixed-precision) against the float64 oracle: docs/testing.md,
# "fp32 against float64". The oracle is not float64 throughout: transformers
# computes RoPE's cos and sin, the attention softmax and the router's
# softmax in float32 and casts back; each adds one float32 rounding (2^-24
# relative) per layer to quantities that enter the loss linearly, well
# inside the bound's sqrt(L n) u = 4.3e-6 estimate.
FP32_BOUND = 1e-5
# bf16 mixed precision: R = 27 roundings of u = 2^-9 on a path, first order
# (docs/testing.md); later steps add the sign flips of AdamW's first
# updates, 2 lr R u |g|_1 per earlier step; only step 1's gradient norm.
BF16_BOUND = 27 * 2.0 ** -9

# Configs given a pad_token_id (transformers then builds the embedding with
# padding_idx: that row gets no gradient from lookups; Llama's head is tied,
# so the row still trains through it).
PADDED = {"tiny_llama3.json": 0, "tiny_mixtral.json": 5}

# The dtype and shard size save_pretrained writes each config in.
STORAGE = {
    "tiny_llama3.json": (torch.float32, None),
    "tiny_mixtral.json": (torch.float32, "40KB"),
    "tiny_qwen3_moe.json": (torch.bfloat16, None),
    "tiny_qwen3_moe_unnormalized.json": (torch.float16, "60KB"),
    "tiny_gpt_oss.json": (torch.float32, None),
    "tiny_deepseek_v3.json": (torch.float32, None),
}


def load_config(path, defaults=None):
    """transformers' own config object for a config.json, with the members
    of `defaults` it lacks."""
    with open(path) as f:
        config = json.load(f)
    for key, value in (defaults or {}).items():
        config.setdefault(key, value)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return transformers.AutoConfig.from_pretrained(d)


@torch.no_grad()
def redraw(model, gen):
    """Weights under which every op moves the loss: transformers' init
    (std 0.02) leaves attention almost uniform, so a wrong softmax scale
    would hardly show. Matrices get std fan_in^-0.5 (activations of order
    1), an untied embedding std 1, norm weights U(0.5, 1.5), biases, sinks and
    DeepSeek's score correction std 0.1; GPT-OSS's gate_up weights are 6
    times larger so that its swiglu clamp (limit 7) is reached."""
    gpt_oss = model.config.model_type == "gpt_oss"
    # A tied embedding is the head too: std hidden^-0.5, as for a matrix.
    tied = model.config.tie_word_embeddings
    named = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers()
        if n.endswith("e_score_correction_bias")]
    for name, w in named:
        def normal(std):
            return torch.randn(w.shape, generator=gen) * std
        if "norm" in name and w.dim() == 1:
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
        elif "embed_tokens" in name and not tied:
            w.copy_(normal(1.0))
        elif w.dim() == 1 or name.endswith(("_bias", "sinks")):
            w.copy_(normal(0.1))
        else:
            # Linear weights are [out, in]; GPT-OSS's fused experts [E, in,
            # out].
            fused_in = gpt_oss and ".experts." in name
            fan_in = w.shape[-2] if fused_in else w.shape[-1]
            scale = 6.0 if gpt_oss and name.endswith("gate_up_proj") else 1.0
            w.copy_(normal(scale * fan_in ** -0.5))


def safetensors_files(directory):
    """The paths of a model directory's safetensors files, sorted."""
    return [os.path.join(directory, name)
            for name in sorted(os.listdir(directory))
            if name.endswith(".safetensors")]


def tensor_shapes(directory):
    """{name: shape} of every safetensors file in a model directory."""
    shapes = {}
    for path in safetensors_files(directory):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def tensor_bytes(directory, keep=lambda name: True):
    """The data bytes of the tensors `keep` accepts in every safetensors file
    of a directory (from the files' headers)."""
    total = 0
    for path in safetensors_files(directory):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for k, t in header.items()
                     if k != "__metadata__" and keep(k))
    return total


def load_oracle(directory, dtype=torch.float64):
    """The transformers model of `directory` (eager attention and experts),
    with from_pretrained's report of the keys it did not match."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    return model, info


def batches(tokens):
    """Step s's (inputs, targets) [BATCH, SEQ]: sequence k is the window of
    SEQ + 1 tokens at k * SEQ (worker/data/token_file.h, strided); step s
    reads sequences [s B, (s + 1) B), as does the evaluation after the last
    step for s = 0."""
    out = []
    for step in range(STEPS):
        rows = torch.tensor([tokens[k * SEQ: k * SEQ + SEQ + 1]
                             for k in range(step * BATCH, (step + 1) * BATCH)])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def loss_of(model, inputs, targets):
    """The mean token cross-entropy, plus router_aux_loss_coef times the
    model's own load-balancing loss when its config asks for router
    logits."""
    aux = bool(getattr(model.config, "output_router_logits", False))
    out = model(input_ids=inputs, output_router_logits=aux) if aux else (
        model(input_ids=inputs))
    loss = F.cross_entropy(out.logits.flatten(0, 1).double(),
                           targets.flatten())
    if aux:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss, out.logits


def gradient_norms(params):
    """(|g|_2, |g|_1) over the parameters' gradients (those that have one)."""
    grads = [w.grad for w in params if w.grad is not None]
    return (torch.sqrt(sum((g ** 2).sum() for g in grads)).item(),
            sum(g.abs().sum() for g in grads).item())


def oracle_steps(model, data, steps=STEPS, near_zero=None):
    """(loss, gradient norm, |gradient|_1) of each step of torch.optim.AdamW
    on `model` (changed in place). `near_zero`, when given, receives for each
    parameter name the mask of the elements whose gradient was within
    FP32_BOUND |g|_2 of 0 at some step: the elements whose AdamW update may
    take the other sign under the workers' rounding."""
    named = [(n, w) for n, w in model.named_parameters() if w.requires_grad]
    trainable = [w for _, w in named]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss, _ = loss_of(model, *data[step])
        loss.backward()
        norm, l1 = gradient_norms(trainable)
        out.append((loss.item(), norm, l1))
        if near_zero is not None:
            for n, w in named:
                if w.grad is not None:
                    mask = w.grad.abs() <= FP32_BOUND * norm
                    near_zero[n] = near_zero.get(n, mask) | mask
        opt.step()
    return out

# Muon (`--optimizer muon`), checked on tiny_qwen3_moe.json at 1 and 2
# workers in fp32 against Keller Jordan's published algorithm, written here
# in float64 (torch.optim.Muon runs Newton-Schulz in bfloat16 and takes no
# 3-D experts), on transformers' own parameters: the attention projections
# and dense MLP matrices, and each expert of the fused experts ([E, out,
# in]); AdamW for the rest (embedding, norms, router, head), as
# worker/exec/muon_optimizer.h assigns them.
MUON_LR, MUON_MOMENTUM, MUON_NS_STEPS = 0.02, 0.95, 5
# Step 1's loss and gradient norm see the same weights: FP32_BOUND. Later
# losses also move by the rounding of the earlier Muon updates: a relative
# gradient error e (<= FP32_BOUND, norm-wise) moves a matrix's normalised
# Nesterov update by <= 2e, and each Newton-Schulz step multiplies a
# perturbation by at most 4.24 (kernels/cpu/muon_test.cc), so the
# orthogonalised update moves by <= NS_GAIN e, NS_GAIN = 2 * 4.24^5; a later
# loss by <= sum over earlier updates and matrices of
# lr * scale * NS_GAIN * e * |g_mat|_F (docs/testing.md).
NS_GAIN = 2 * 4.24 ** MUON_NS_STEPS


def muon_kind(name, w):
    """'matrix', 'experts' or None (AdamW) for a transformers parameter."""
    if ".mlp.experts." in name:
        return "experts" if w.dim() == 3 else None
    if ".mlp.gate." in name or ".mlp.router." in name:
        return None  # The router.
    if (w.dim() == 2 and name.endswith(".weight") and "norm" not in name
            and (".self_attn." in name or ".mlp." in name)):
        return "matrix"
    return None


def newton_schulz(g, steps=MUON_NS_STEPS):
    """The published quintic iteration on the last two dimensions."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.clone()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.transpose(-2, -1)
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.transpose(-2, -1) if tall else x


class Muon:
    """Muon with Nesterov momentum on `params` (name -> parameter, [out,
    in] or [E, out, in]); the scale sqrt(max(1, out / in))."""

    def __init__(self, params, lr, weight_decay):
        self.params, self.lr, self.wd = params, lr, weight_decay
        self.momentum = {n: torch.zeros_like(w) for n, w in params.items()}
        self.scales = {n: max(1.0, w.size(-2) / w.size(-1)) ** 0.5
                       for n, w in params.items()}

    @torch.no_grad()
    def step(self):
        for n, w in self.params.items():
            m = self.momentum[n]
            m.lerp_(w.grad, 1 - MUON_MOMENTUM)
            x = newton_schulz(w.grad.lerp(m, MUON_MOMENTUM))
            w.mul_(1 - self.lr * self.wd)
            w.add_(x * self.scales[n], alpha=-self.lr)


def muon_oracle_steps(model, data):
    """(loss, gradient norm, this step's |dL| per unit relative gradient
    error of each earlier Muon update) of each step."""
    named = [(n, w) for n, w in model.named_parameters() if w.requires_grad]
    muon = Muon({n: w for n, w in named if muon_kind(n, w)}, MUON_LR,
                WEIGHT_DECAY)
    adamw = torch.optim.AdamW([w for n, w in named if not muon_kind(n, w)],
                              lr=LR, betas=BETAS, eps=EPS,
                              weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(STEPS):
        for _, w in named:
            w.grad = None
        loss, _ = loss_of(model, *data[step])
        loss.backward()
        norm, _ = gradient_norms(w for _, w in named)
        term = sum(MUON_LR * muon.scales[n] * NS_GAIN * w.grad.norm().item()
                   for n, w in muon.params.items())
        out.append((loss.item(), norm, term))
        adamw.step()
        muon.step()
    return out


# Deliberate errors patched into transformers' own modules: each must move
# step 1 outside the bound.
@contextlib.contextmanager
def patched(changes):
    """Sets each (object, attribute, value) of `changes` for the block and
    restores the old values after it. Refuses an empty list: a mutation that
    finds nothing to change would check nothing."""
    assert changes, "the mutation found nothing to change"
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in changes]
    for obj, attr, value in changes:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def wrong_softmax_scale(model):
    """Attention scores times head_dim^-1 instead of head_dim^-0.5."""
    return patched([(m, "scaling", m.scaling ** 2)
                    for name, m in model.named_modules()
                    if name.endswith("self_attn") and hasattr(m, "scaling")])


def rotate_pairs(x):
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def wrong_rope_pairing(model):
    """RoPE rotating adjacent pairs (2i, 2i + 1) where the architecture
    rotates halves (i, i + d/2), or halves where it de-interleaves."""
    return patched([(sys.modules[type(model).__module__], "rotate_half",
                     rotate_pairs)])


def wrong_renormalisation(model):
    """The top-k router weights renormalised where the architecture does
    not, or not where it does."""
    return patched([(m, "norm_topk_prob", not m.norm_topk_prob)
                    for m in model.modules()
                    if hasattr(m, "norm_topk_prob")])


def no_aux_loss(model):
    """The load-balancing term left out."""
    return patched([(model.config, "router_aux_loss_coef", 0.0)])


def no_correction_bias(model):
    """DeepSeek-V3's e_score_correction_bias ignored in the choice."""
    return patched([(m, "e_score_correction_bias",
                     torch.zeros_like(m.e_score_correction_bias))
                    for m in model.modules()
                    if "e_score_correction_bias" in m._buffers])


def no_swiglu_clamp(model):
    """GPT-OSS's experts without the clamp at swiglu_limit."""
    return patched([(m, "limit", float("inf")) for m in model.modules()
                    if hasattr(m, "limit") and hasattr(m, "alpha")])


def padded_embeddings(model):
    return [m for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None]


def no_padding_idx(model):
    """The padding row trained by lookups too (every embedding module: a
    tied table may sit in several)."""
    return patched([(m, "padding_idx", None)
                    for m in padded_embeddings(model)])


def mutations(model):
    """The deliberate errors that apply to this model (each also shows
    that what it removes matters here)."""
    out = [("a wrong softmax scale", wrong_softmax_scale)]
    if padded_embeddings(model):
        out.append(("no padding_idx", no_padding_idx))
    if getattr(model.config, "output_router_logits", False):
        out.append(("no load-balancing term", no_aux_loss))
    if any(n.endswith("e_score_correction_bias")
           for n, _ in model.named_buffers()):
        out.append(("no score correction bias", no_correction_bias))
    if any(hasattr(m, "limit") and hasattr(m, "alpha")
           for m in model.modules()):
        out.append(("no swiglu clamp", no_swiglu_clamp))
    if hasattr(sys.modules[type(model).__module__], "rotate_half"):
        out.append(("a wrong RoPE pairing", wrong_rope_pairing))
    if any(hasattr(m, "norm_topk_prob") for m in model.modules()):
        out.append(("a wrong router renormalisation", wrong_renormalisation))
    return out


class Tally:
    def __init__(self):
        self.failures, self.checks = 0, 0
        self.worst = {"fp32": 0.0, "bf16": 0.0}

    def add(self, ok, worst=0.0, kind="fp32"):
        self.checks += 1
        self.failures += not ok
        self.worst[kind] = max(self.worst[kind], worst)
        return "ok" if ok else "FAIL"

    def summary(self):
        """Prints the closing line; returns the test's exit code."""
        print(f"{self.checks} checks: largest fp32 error "
              f"{self.worst['fp32']:.2e}, bf16 {self.worst['bf16']:.2e}; "
              f"{self.failures} failed")
        return 1 if self.failures else 0


class ConfigCheck:
    def __init__(self, cluster, work, config, tally, seed):
        self.cluster, self.work, self.tally = cluster, work, tally
        self.name = os.path.basename(config)
        self.hf_dir = os.path.join(work, self.name + ".hf")
        dtype, shard = STORAGE.get(self.name, (torch.float32, None))
        gen = torch.Generator().manual_seed(seed)
        hf_config = load_config(config)
        if self.name in PADDED:
            hf_config.pad_token_id = PADDED[self.name]
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="eager", dtype=torch.float32)
        redraw(model, gen)
        model.to(dtype).save_pretrained(
            self.hf_dir, **({"max_shard_size": shard} if shard else {}))
        if dtype != torch.float32:
            # The files hold BF16 or F16; the config's dtype is the dtype the
            # parameters train in (shardd's --no-mixed-precision computes in
            # it), and these runs train in float32.
            path = os.path.join(self.hf_dir, "config.json")
            with open(path) as f:
                saved = json.load(f)
            saved["dtype"] = "float32"
            with open(path, "w") as f:
                json.dump(saved, f, indent=2)
        self.shapes = tensor_shapes(self.hf_dir)
        self.tensor_bytes = tensor_bytes(self.hf_dir)
        files = sorted(f for f in os.listdir(self.hf_dir)
                       if f.endswith(".safetensors"))
        vocab = model.config.vocab_size
        self.tokens = torch.randint(0, vocab, (STEPS * BATCH * SEQ + 1,),
                                    generator=gen).tolist()
        if model.config.pad_token_id is not None:
            # The padding token in every step's batch, twice.
            for step in range(STEPS):
                for k in (3, SEQ + 7):
                    self.tokens[step * BATCH * SEQ + k] = (
                        model.config.pad_token_id)
        self.data_path = os.path.join(work, self.name + ".bin")
        with open(self.data_path, "wb") as f:
            f.write(struct.pack(f"<{len(self.tokens)}H", *self.tokens))
        self.data = batches(self.tokens)
        oracle, info = load_oracle(self.hf_dir)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise RuntimeError(f"{self.hf_dir} does not load back into "
                               f"transformers: {problems}")
        self.architecture = type(oracle).__name__
        self.moe = any(".experts." in k for k in self.shapes)
        self.near_zero = {}
        self.want = oracle_steps(oracle, self.data, near_zero=self.near_zero)
        self.trained = oracle  # After STEPS updates.
        print(f"{self.name} ({self.architecture}, {str(dtype)[6:]} in "
              f"{len(files)} file(s), {len(self.shapes)} tensors"
              f"{', load-balancing loss' if self.aux() else ''}): "
              "transformers' losses "
              + ", ".join(f"{w[0]:.9f}" for w in self.want))

    def aux(self):
        return bool(getattr(self.trained.config, "output_router_logits",
                            False))

    def runs(self):
        """(dp, replicas, strategy, mixed precision)."""
        if self.aux():
            # The load-balancing term's statistics are summed over the
            # ranks: every world size; the strategies are the other
            # configs' to cover.
            return [(w, 1, "default", False) for w in (1, 2, 4)] + [
                (2, 1, "default", True)]
        strategies = ["default", "megatron_fsdp"] + (
            ["diffusion_gemma"] if self.moe else [])
        runs = [(w, 1, s, False) for w in (1, 2, 4) for s in strategies]
        return runs + [(2, 2, "default", False), (2, 1, "default", True)]

    def compare(self, got, want, mixed):
        """(largest relative error, largest ratio to its bound)."""
        bound = BF16_BOUND if mixed else FP32_BOUND
        errs, ratios, flips = [], [], 0.0
        for step, ((gl, gn), (wl, wn, l1)) in enumerate(zip(got, want)):
            errs.append(abs(gl - wl) / abs(wl))
            ratios.append(errs[-1] / (bound + (flips / abs(wl)
                                               if mixed else 0)))
            if not mixed or step == 0:
                errs.append(abs(gn - wn) / abs(wn))
                ratios.append(errs[-1] / bound)
            flips += 2 * LR * BF16_BOUND * l1
        return max(errs), max(ratios)

    def check_run(self, world, replicas, strategy, mixed):
        mesh = f"{world}" if replicas == 1 else f"{world}x{replicas}"
        sizes = self.cluster.worker_log_sizes()
        got, _, _ = train(self.cluster, self.hf_dir, self.hf_dir,
                          self.data_path, world, strategy, mixed,
                          extra=["--replicate", str(replicas)])
        worst, ratio = self.compare(got, self.want, mixed)
        # Every element is owned by one rank of a replica: each replica reads
        # the checkpoint's tensor bytes exactly once (GPT-OSS's interleaved
        # gate/up rows may be read whole at a range's ends).
        read = self.cluster.bytes_read_since(sizes)
        want_read = self.tensor_bytes * replicas
        read_ok = (read >= want_read if self.architecture == "GptOssForCausalLM"
                   else read == want_read)
        kind = "bf16" if mixed else "fp32"
        status = self.tally.add(ratio <= 1 and read_ok, worst, kind)
        print(f"  {status} {mesh} worker(s) {strategy:14s} {kind}: largest "
              f"relative error {worst:.2e}, {ratio:.2f} of its bound; "
              f"{read} bytes read ({replicas} x {self.tensor_bytes} wanted)")
        if status == "FAIL":
            print("    shardd", got, "\n    transformers", self.want)
        if world == 1 and strategy == "default" and not mixed:
            self.step1 = got[0]

    def check_mutations(self):
        """Step 1 of a wrong oracle must miss shardd's step 1."""
        oracle, _ = load_oracle(self.hf_dir)
        gl, gn = self.step1
        for label, mutation in mutations(oracle):
            with mutation(oracle):
                wl, wn, _ = oracle_steps(oracle, self.data, steps=1)[0]
            err = max(abs(gl - wl) / abs(wl), abs(gn - wn) / abs(wn))
            status = self.tally.add(err > FP32_BOUND)
            print(f"  {status} transformers with {label} misses shardd's "
                  f"step 1 by {err:.2e} (bound {FP32_BOUND:.0e})")

    def check_muon(self):
        """`--optimizer muon` at 1 and 2 workers (default strategy, fp32):
        each step's loss within FP32_BOUND plus the earlier updates' term,
        step 1's gradient norm within FP32_BOUND."""
        oracle, _ = load_oracle(self.hf_dir)
        want = muon_oracle_steps(oracle, self.data)
        # Each of the s updates before step s adds want[s][2] * FP32_BOUND.
        extra = [s * want[s][2] * FP32_BOUND for s in range(STEPS)]
        for world in (1, 2):
            got, _, _ = train(self.cluster, self.hf_dir, self.hf_dir,
                              self.data_path, world, "default", False,
                              extra=["--optimizer", "muon", "--muon-lr",
                                     str(MUON_LR), "--muon-momentum",
                                     str(MUON_MOMENTUM), "--muon-ns-steps",
                                     str(MUON_NS_STEPS)])
            ratios, errs = [], []
            for step, ((gl, gn), (wl, wn, _)) in enumerate(zip(got, want)):
                errs.append(abs(gl - wl) / abs(wl))
                ratios.append(errs[-1] / (FP32_BOUND + extra[step] / abs(wl)))
                if step == 0:
                    errs.append(abs(gn - wn) / abs(wn))
                    ratios.append(errs[-1] / FP32_BOUND)
            status = self.tally.add(max(ratios) <= 1, max(errs))
            print(f"  {status} {world} worker(s) default        fp32 muon: "
                  "losses " + ", ".join(f"{g[0]:.9f}" for g in got) + " vs "
                  + ", ".join(f"{w[0]:.9f}" for w in want)
                  + f"; largest relative error {max(errs):.2e}, "
                  f"{max(ratios):.2f} of its bound")
        # Muon must have changed the trajectory.
        moved = abs(want[1][0] - self.want[1][0]) > 1e-6
        print(f"  {self.tally.add(moved)} Muon's step 2 differs from AdamW's")

    def check_export(self):
        """Export after 3 steps; from_pretrained; logits on a held batch."""
        _, saved, _ = train(self.cluster, self.hf_dir, self.hf_dir,
                            self.data_path, 2, "default", False,
                            extra=["--checkpoint-every", str(STEPS)])
        out = os.path.join(self.work, self.name + ".export")
        self.cluster.shardctl_local([
            "checkpoint", "export", "--checkpoint",
            os.path.join(self.cluster.checkpoints, saved[-1]), "--hf", out])
        exported, info = load_oracle(out)
        problems = {k: v for k, v in info.items() if v}
        shapes = tensor_shapes(out)
        layout_ok = shapes == self.shapes
        status = self.tally.add(not problems and layout_ok)
        detail = "" if layout_ok else (
            f"; names only in the export: "
            f"{sorted(set(shapes) - set(self.shapes))[:4]}, only in "
            f"save_pretrained's: {sorted(set(self.shapes) - set(shapes))[:4]}")
        print(f"  {status} checkpoint export --hf loads with from_pretrained: "
              f"{problems or 'no missing, unexpected or mismatched keys'}; "
              f"{len(shapes)} tensors in save_pretrained's layout: "
              f"{layout_ok}{detail}")
        # A held-out batch: tokens no step trained on.
        gen = torch.Generator().manual_seed(99)
        held = torch.randint(0, exported.config.vocab_size, (BATCH, SEQ),
                             generator=gen)
        with torch.no_grad():
            got = exported(input_ids=held).logits
            want = self.trained(input_ids=held).logits
        err = ((got - want).norm() / want.norm()).item()
        flips = self.flip_term(exported, held) / want.norm().item()
        bound = FP32_BOUND + flips
        status = self.tally.add(err <= bound, err)
        print(f"  {status} the export's logits on a held-out batch: relative "
              f"L2 distance {err:.2e} from transformers' trained model "
              f"(bound {FP32_BOUND:.0e} + {flips:.1e} for the elements whose "
              "update may flip)")

    def flip_term(self, exported, held):
        """|J d| (float64): d is the export's difference from the trained
        model's weights on the elements whose gradient was within rounding
        of 0 at some step (an AdamW update there may take either sign, up
        to 2 lr), J the logits' Jacobian at the trained weights. Every other
        element must agree to rounding: a layout or naming error there is
        not excused."""
        from torch.func import functional_call, jvp
        theirs = dict(exported.named_parameters())
        names, primals, tangents = [], [], []
        for n, w in self.trained.named_parameters():
            if n in self.near_zero:
                names.append(n)
                primals.append(w.detach())
                tangents.append((theirs[n].detach() - w.detach())
                                * self.near_zero[n])

        def logits(*weights):
            return functional_call(self.trained, dict(zip(names, weights)),
                                   (held,)).logits
        _, moved = jvp(logits, tuple(primals), tuple(tangents))
        return moved.norm().item()


def main():
    bin_dir, configs = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    tally = Tally()
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(bin_dir, work)
        try:
            for i, config in enumerate(configs):
                check = ConfigCheck(cluster, work, config, tally, seed=11 + i)
                for run in check.runs():
                    check.check_run(*run)
                check.check_mutations()
                if check.name == "tiny_qwen3_moe.json":
                    check.check_muon()
                check.check_export()
        finally:
            cluster.stop()
    return tally.summary()


if __name__ == "__main__":
    sys.exit(main())
