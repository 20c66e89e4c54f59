"""The CPU model's step against a plain-PyTorch reference, per architecture.

model_dump runs one training step of shardd's CPU model on random fp32
weights and writes the weights, tokens, loss and gradients. This test
recomputes the step in float64 with PyTorch, written from Hugging Face's
published definitions (modeling_llama.py, modeling_mixtral.py,
modeling_qwen3_moe.py, modeling_gpt_oss.py, modeling_rope_utils.py):
RMSNorm, q/k/v projections (with biases for GPT-OSS),
Qwen3's per-head q/k RMSNorm, rotate-half RoPE (default and llama3
frequencies), causal or sliding-window grouped-query attention with softmax
scale head_dim^-0.5, o_proj, residual, post_attention_layernorm, then a
softmax router over all experts whose top-k weights are renormalised
(Mixtral; Qwen3's norm_topk_prob) or not (Qwen3 without it) with SwiGLU experts, or a SwiGLU MLP
(Llama), residual, the final norm, lm_head (tied or not) and the mean token
cross-entropy; autograd gives the gradients.

GPT-OSS adds yarn RoPE (truncated or not, with its attention factor on cos
and sin), learned per-head attention sinks (a softmax over the scores and
the sink, the sink column dropped), a router that takes the top-k of
x W^T + b and a softmax over those k, and experts with biases and the
clamped "swigluoai" activation. Its experts are computed as Hugging Face
writes them, on the checkpoint's interleaved gate/up columns: the
reference interleaves shardd's concatenated halves itself (gate column i
of shardd is HF column 2i, up column i is 2i + 1), so a mix-up of the two
layouts fails the test.

DeepSeek-V3 (modeling_deepseek_v3.py) adds multi-head latent attention:
q = q_b_proj(RMSNorm(q_a_proj x)), kv_a_proj_with_mqa x split into the
latent (kv_a_layernorm, kv_b_proj -> per-head k_nope and v) and one shared
rope key; both latent norms with DeepseekV3RMSNorm's default eps 1e-6;
RoPE applied as apply_rotary_pos_emb_interleave does (de-interleave the
rope dims, then rotate_half), yarn over qk_rope_head_dim; the softmax
scale qk_head_dim^-0.5 * yarn_get_mscale(factor, mscale_all_dim)^2. Its
DeepseekV3TopkRouter scores sigmoid(x W^T), chooses on the scores plus
e_score_correction_bias within the topk_group of n_group groups ranked by
their two best (others masked to 0), weighs by the unbiased scores
renormalised and times routed_scaling_factor; a shared SwiGLU expert is
added, and the first first_k_dense_replace layers are a dense SwiGLU MLP.
The correction bias is a buffer: no gradient.

DiffusionGemma (modeling_diffusion_gemma.py, DiffusionGemmaEncoderTextModel:
the causal pass over clean tokens that its training runs first) is computed
by gemma_forward(): the embedding times sqrt(hidden); per layer
input_layernorm, q_proj / k_proj (and v_proj on sliding layers; full
layers take the values from k_proj's output), q_norm / k_norm per head, a
per-head RMSNorm without weight on the values, RoPE per layer type (sliding:
default over head_dim; full: proportional over global_head_dim, a quarter of
the frequencies nonzero), attention with scaling 1.0 under the causal mask
(sliding layers: the window too), o_proj, post_attention_layernorm, the
residual; then mlp between pre_feedforward_layernorm and
post_feedforward_layernorm_1, in parallel the router (RMSNorm without
weight of the residual, times scale and hidden^-0.5, proj, softmax, top-k
renormalised; per_expert_scale folded into down_projs) and the GeGLU experts
between pre_feedforward_layernorm_2 and post_feedforward_layernorm_2; their
sum through post_feedforward_layernorm, the residual, times layer_scalar;
the final norm, the tied head, cap * tanh(logits / cap), the mean
cross-entropy. The router, layer_scalar (frozen) and self_conditioning
(unused by this pass) get no gradient.

With `output_router_logits: true` (dims.router_aux_loss_coef > 0) the loss
is MixtralForCausalLM's (and Qwen3-MoE's, GPT-OSS's): CE +
router_aux_loss_coef * load_balancing_loss_func(router logits of every MoE
layer, E, top_k, attention_mask=None): softmax of the concatenated logits
(GPT-OSS's with the router bias, as transformers 5 records them), top-k of
those probabilities, E * sum(mean one-hot mask [k, E] * mean probability
[E]).

Usage: hf_reference_test.py MODEL_DUMP CONFIG.json [CONFIG.json ...]
"""

import json
import math
import os
import subprocess
import sys
import tempfile

import torch

torch.set_default_dtype(torch.float64)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemma_reference import (gemma_block_diffusion_step,  # noqa: E402
                             gemma_forward)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def yarn_frequencies(rope_spec, head_dim):
    """modeling_rope_utils' yarn frequencies and attention factor, float64."""
    theta = rope_spec["theta"]
    factor = rope_spec["factor"]
    original = float(rope_spec["original_max_position_embeddings"])
    beta_fast = rope_spec.get("beta_fast") or 32.0
    beta_slow = rope_spec.get("beta_slow") or 1.0

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if not rope_spec.get("untruncated", False):  # HF's truncate (default)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2) / head_dim)
    ramp = ((torch.arange(head_dim // 2) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs) * (1 - extrapolation)
                + 1.0 / pos_freqs * extrapolation)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope_spec.get("attention_factor") or 0.0
    if not attention:
        m, m_all = rope_spec.get("mscale") or 0.0, rope_spec.get("mscale_all_dim") or 0.0
        attention = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                     else mscale(factor))
    return inv_freq, attention


def inv_frequencies(rope_spec, head_dim):
    """modeling_rope_utils' default and llama3 frequencies, in float64."""
    theta = rope_spec["theta"]
    if rope_spec.get("type", "default") == "yarn":
        return yarn_frequencies(rope_spec, head_dim)[0]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2) / head_dim))
    if rope_spec.get("type", "default") == "llama3":
        factor = rope_spec["factor"]
        low, high = rope_spec["low_freq_factor"], rope_spec["high_freq_factor"]
        old = float(rope_spec["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope(x, positions, rope_spec, head_dim):
    # x: [B, H, S, hd]; HF: emb = cat(freqs, freqs), q*cos + rotate_half*sin.
    # The fp32 frequencies and angles the workers use (as Hugging Face's
    # fp32 rotary embedding computes them), then exact cos / sin.
    inv_freq = inv_frequencies(rope_spec, head_dim).float()
    freqs = (positions.float()[:, None] * inv_freq[None, :]).double()
    emb = torch.cat((freqs, freqs), dim=-1)
    # yarn scales cos and sin by its attention factor; HF rounds it to fp32
    # with the table, as the workers do.
    scale = 1.0
    if rope_spec.get("type", "default") == "yarn":
        scale = float(torch.tensor(yarn_frequencies(rope_spec, head_dim)[1],
                                   dtype=torch.float32))
    return x * (emb.cos() * scale) + rotate_half(x) * (emb.sin() * scale)


def rope_interleave(x, positions, rope_spec, head_dim):
    """apply_rotary_pos_emb_interleave: pairs (2i, 2i+1) -> halves, then
    rotate_half, so the output is in the de-interleaved order."""
    lead = x.shape[:-1]
    x = x.reshape(*lead, head_dim // 2, 2).transpose(-1, -2).reshape(
        *lead, head_dim)
    return rope(x, positions, rope_spec, head_dim)


def yarn_get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_attention(h, p, pre, d, positions, causal):
    """DeepseekV3Attention.forward (eager, causal), float64."""
    b, s, _ = h.shape
    mla = d["attention"]["mla"]
    rope_spec = d["attention"]["rope"]
    hq = int(d["num_attention_heads"])
    nope, rot = int(mla["qk_nope_head_dim"]), int(mla["qk_rope_head_dim"])
    dv, kv_lora = int(mla["v_head_dim"]), int(mla["kv_lora_rank"])
    a = pre + "self_attn."
    if a + "q_a_proj.weight" in p:
        q = rms_norm(h @ p[a + "q_a_proj.weight"].T,
                     p[a + "q_a_layernorm.weight"], 1e-6)
        q = q @ p[a + "q_b_proj.weight"].T
    else:
        q = h @ p[a + "q_proj.weight"].T
    q = q.view(b, s, hq, nope + rot).transpose(1, 2)
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    compressed = h @ p[a + "kv_a_proj_with_mqa.weight"].T
    k_pass, k_rot = compressed[..., :kv_lora], compressed[..., kv_lora:]
    k_pass = rms_norm(k_pass, p[a + "kv_a_layernorm.weight"], 1e-6)
    k_pass = (k_pass @ p[a + "kv_b_proj.weight"].T).view(
        b, s, hq, nope + dv).transpose(1, 2)
    k_pass, v = k_pass[..., :nope], k_pass[..., nope:]
    k_rot = k_rot.view(b, 1, s, rot)
    if rope_spec.get("interleaved", False):
        q_rot = rope_interleave(q_rot, positions, rope_spec, rot)
        k_rot = rope_interleave(k_rot, positions, rope_spec, rot)
    else:
        q_rot = rope(q_rot, positions, rope_spec, rot)
        k_rot = rope(k_rot, positions, rope_spec, rot)
    k_rot = k_rot.expand(b, hq, s, rot)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key = torch.cat((k_pass, k_rot), dim=-1)
    # From the rope parameters themselves, not the spec's softmax_scale.
    scaling = (nope + rot) ** -0.5
    if rope_spec.get("mscale_all_dim"):
        m = yarn_get_mscale(rope_spec["factor"], rope_spec["mscale_all_dim"])
        scaling = scaling * m * m
    probs = torch.softmax(query @ key.transpose(-1, -2) * scaling + causal,
                          dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, hq * dv)
    return out @ p[a + "o_proj.weight"].T


def deepseek_router(h, p, pre, d, stats):
    """DeepseekV3TopkRouter.forward: (indices, weights) per token."""
    e_count = p[pre + "moe.gate.weight"].shape[0]
    n_group, topk_group = int(d["n_group"]), int(d["topk_group"])
    top_k = int(d["top_k"])
    scores = torch.sigmoid(h @ p[pre + "moe.gate.weight"].T)  # [B, S, E]
    flat = scores.reshape(-1, e_count)
    bias = p[pre + "moe.gate.e_score_correction_bias"]

    def choose(correction):
        with torch.no_grad():
            choice = flat + correction.unsqueeze(0)
            group = choice.view(-1, n_group, e_count // n_group).topk(
                2, dim=-1)[0].sum(dim=-1)
            kept = torch.topk(group, k=topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group).scatter_(1, kept, 1)
            mask = mask.unsqueeze(-1).expand(
                -1, n_group, e_count // n_group).reshape(-1, e_count)
            choice = choice.masked_fill(~mask.bool(), 0.0)
            return torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]

    chosen = choose(bias)
    # The bias must change some choices, or it went unchecked.
    plain = choose(torch.zeros_like(bias))
    stats["bias_changed"] += int(
        (chosen.sort(-1)[0] != plain.sort(-1)[0]).any(-1).sum())
    stats["routed"] += chosen.shape[0]
    weights = flat.gather(1, chosen)
    if d.get("norm_topk_prob", False):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * d["routed_scaling_factor"]
    return chosen.view(*h.shape[:2], top_k), weights.view(*h.shape[:2], top_k)


def interleave(gate, up):
    """shardd's concatenated halves -> Hugging Face's interleaved columns."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


def gpt_oss_experts(h, p, pre, chosen, weights, d, stats):
    """GptOssExperts.forward on HF's interleaved layout, as published."""
    inter = p[pre + "moe.experts.down_projs"].shape[1]
    w_gu = p[pre + "moe.experts.gate_and_up_projs"]  # [E, D, 2I] halves
    b_gu = p[pre + "moe.experts.gate_up_proj_bias"]  # [E, 2I] halves
    gate_up_proj = interleave(w_gu[..., :inter], w_gu[..., inter:])
    gate_up_proj_bias = interleave(b_gu[..., :inter], b_gu[..., inter:])
    down_proj = p[pre + "moe.experts.down_projs"]
    down_proj_bias = p[pre + "moe.experts.down_proj_bias"]
    alpha, limit = d["swiglu_alpha"], d["swiglu_limit"]
    out = torch.zeros_like(h)
    for slot in range(chosen.shape[-1]):
        e = chosen[..., slot]  # [B, S]
        gate_up = (torch.einsum("bsd,bsdf->bsf", h, gate_up_proj[e])
                   + gate_up_proj_bias[e])
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        stats["gate_clamped"] += int((gate > limit).sum())
        stats["up_clamped"] += int((up.abs() > limit).sum())
        stats["values"] += gate.numel()
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        y = (torch.einsum("bsi,bsid->bsd", (up + 1) * glu, down_proj[e])
             + down_proj_bias[e])
        out = out + y * weights[..., slot : slot + 1]
    return out


def load_balancing_loss(router_logits, num_experts, top_k):
    """HF's load_balancing_loss_func without an attention mask."""
    logits = torch.cat([l.reshape(-1, num_experts) for l in router_logits])
    routing_weights = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(routing_weights, top_k, dim=-1)
    mask = torch.nn.functional.one_hot(selected, num_experts).to(logits.dtype)
    tokens_per_expert = mask.mean(dim=0)  # [k, E]
    router_prob_per_expert = routing_weights.mean(dim=0)  # [E]
    return num_experts * torch.sum(
        tokens_per_expert * router_prob_per_expert.unsqueeze(0))


def forward(dump, p, stats=None):
    """The mean loss; GPT-OSS's clamp counts go to `stats` when given."""
    if stats is None:
        stats = {}
    for key in ("gate_clamped", "up_clamped", "values", "bias_changed",
                "routed"):
        stats.setdefault(key, 0)
    if dump["architecture"] == "DiffusionGemmaForBlockDiffusion":
        return gemma_forward(dump, p)
    d = dump["dims"]
    b, s = dump["batch"], dump["seq"]
    eps = d["rms_norm_eps"]
    # Proto JSON writes int64 fields as strings.
    hq, hkv, hd = (int(d["num_attention_heads"]), int(d["num_key_value_heads"]),
                   int(d["head_dim"]))
    attention = d["attention"]
    rope_spec = attention["rope"]
    top_k = int(d["top_k"])
    aux_coef = float(d.get("router_aux_loss_coef", 0.0))
    router_logits = []  # Every MoE layer's [B, S, E], for the aux loss.
    tokens = torch.tensor(dump["inputs"]).view(b, s)
    x = p["model.embed_tokens.weight"][tokens]  # [B, S, D]
    positions = torch.arange(s)
    causal = torch.full((s, s), float("-inf")).triu(1)
    window = int(attention.get("sliding_window", 0))
    sliding = torch.where(
        positions[:, None] - positions[None, :] >= max(window, 1),
        float("-inf"), 0.0) + causal
    sliding_layers = attention.get("sliding_layers", [])
    layer = 0
    while f"model.layers.{layer}.input_layernorm.weight" in p:
        pre = f"model.layers.{layer}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        if pre + "self_attn.kv_a_proj_with_mqa.weight" in p:
            # DeepseekV3DecoderLayer: latent attention, then DeepseekV3MoE
            # (routed experts + shared expert) or the dense DeepseekV3MLP.
            x = x + deepseek_attention(h, p, pre, d, positions, causal)
            h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
            if pre + "moe.gate.weight" in p:
                chosen, weights = deepseek_router(h, p, pre, d, stats)
                w_gu = p[pre + "moe.experts.gate_and_up_projs"]
                w_d = p[pre + "moe.experts.down_projs"]
                inter = w_d.shape[1]
                for slot in range(top_k):
                    e = chosen[..., slot]
                    gu = torch.einsum("bsd,bsdf->bsf", h, w_gu[e])
                    act = (torch.nn.functional.silu(gu[..., :inter])
                           * gu[..., inter:])
                    y = torch.einsum("bsi,bsid->bsd", act, w_d[e])
                    x = x + weights[..., slot : slot + 1] * y
                mlp = pre + "moe.shared_experts."
            else:
                mlp = pre + "mlp."
            g = h @ p[mlp + "gate_proj.weight"].T
            u = h @ p[mlp + "up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ p[mlp + "down_proj.weight"].T
            layer += 1
            continue
        def proj(name, heads):
            y = h @ p[pre + f"self_attn.{name}.weight"].T
            if pre + f"self_attn.{name}.bias" in p:
                y = y + p[pre + f"self_attn.{name}.bias"]
            return y.view(b, s, heads, hd)

        q, k, v = proj("q_proj", hq), proj("k_proj", hkv), proj("v_proj", hkv)
        if pre + "self_attn.q_norm.weight" in p:
            q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = rope(q, positions, rope_spec, hd)
        k = rope(k, positions, rope_spec, hd)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        is_sliding = layer < len(sliding_layers) and sliding_layers[layer]
        mask = sliding if is_sliding else causal
        scores = q @ k.transpose(-1, -2) * hd ** -0.5 + mask
        if pre + "self_attn.sinks" in p:
            # GPT-OSS: the sink joins each row's softmax, then is dropped.
            sinks = p[pre + "self_attn.sinks"].reshape(1, hq, 1, 1)
            combined = torch.cat((scores, sinks.expand(b, hq, s, 1)), dim=-1)
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        attn = probs @ v  # [B, Hq, S, hd]
        attn = attn.transpose(1, 2).reshape(b, s, hq * hd)
        x = x + attn @ p[pre + "self_attn.o_proj.weight"].T
        if pre + "self_attn.o_proj.bias" in p:
            x = x + p[pre + "self_attn.o_proj.bias"]
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        if d.get("router_scoring") == "ROUTER_TOPK_THEN_SOFTMAX":
            # GptOssTopKRouter, then GptOssExperts.
            logits = h @ p[pre + "moe.gate.weight"].T + p[pre + "moe.gate.bias"]
            router_logits.append(logits)
            top, chosen = torch.topk(logits, top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
            x = x + gpt_oss_experts(h, p, pre, chosen, weights, d, stats)
        elif pre + "moe.gate.weight" in p:
            logits = h @ p[pre + "moe.gate.weight"].T  # [B, S, E]
            router_logits.append(logits)
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = torch.topk(probs, top_k, dim=-1)
            if d.get("norm_topk_prob", False):
                weights = weights / weights.sum(-1, keepdim=True)
            w_gu = p[pre + "moe.experts.gate_and_up_projs"]  # [E, D, 2I]
            w_d = p[pre + "moe.experts.down_projs"]  # [E, I, D]
            inter = w_d.shape[1]
            out = torch.zeros_like(h)
            for slot in range(top_k):
                e = chosen[..., slot]  # [B, S]
                gu = torch.einsum("bsd,bsdf->bsf", h, w_gu[e])
                a = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
                y = torch.einsum("bsi,bsid->bsd", a, w_d[e])
                out = out + weights[..., slot : slot + 1] * y
            x = x + out
        if pre + "mlp.gate_proj.weight" in p:
            g = h @ p[pre + "mlp.gate_proj.weight"].T
            u = h @ p[pre + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ p[pre + "mlp.down_proj.weight"].T
        layer += 1
    h = rms_norm(x, p["model.norm.weight"], eps)
    head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
    logits = h @ head.T
    targets = torch.tensor(dump["targets"])
    loss = torch.nn.functional.cross_entropy(logits.view(b * s, -1), targets)
    if aux_coef > 0:
        aux = load_balancing_loss(router_logits, int(d["num_experts"]), top_k)
        stats["aux"] = aux.item()
        loss = loss + aux_coef * aux
    return loss


def check(dump_binary, config, diffusion=False, response=0):
    """Returns the number of checks out of bounds for one config; with
    `diffusion`, of DiffusionGemma's 3-pass block-diffusion step (its canvas
    the last `response` tokens, 0: one block of canvas_length)."""
    with open(config) as f:
        gpt_oss = json.load(f).get("architectures") == ["GptOssForCausalLM"]
    # GPT-OSS: expert weights 6x larger give gate / up values with a spread
    # of about 5, so the clamp at 7 cuts some of them.
    extra = ["--gate_up_scale=6"] if gpt_oss else []
    # Step 7 draws noise levels 0.54 and 0.93 and coins (1, 0) for the two
    # sequences: both decode inputs are exercised.
    if diffusion:
        extra = ["--diffusion_step", "--step=7",
                 f"--response_length={response}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dump.json")
        subprocess.run(
            [dump_binary, f"--model={config}", "--batch=2", "--seq=24",
             "--seed=3", f"--out={out}"] + extra,
            check=True, timeout=120)
        with open(out) as f:
            dump = json.load(f)
    # Frozen parameters (DeepSeek-V3's e_score_correction_bias, a buffer in
    # HF; DiffusionGemma's router and layer_scalar) get no gradient, here as
    # in shardd; neither does DiffusionGemma's self_conditioning, which the
    # causal pass never reads.
    frozen = {name for name in dump["params"]
              if name.endswith(("e_score_correction_bias", "moe.gate.scale",
                                "moe.gate.proj.weight", "layer_scalar"))
              or (name.startswith("model.self_conditioning.")
                  and not diffusion)}
    params = {
        name: torch.tensor(t["values"]).view(t["shape"]).requires_grad_(
            name not in frozen)
        for name, t in dump["params"].items()
    }
    stats = {}
    failures = 0
    if diffusion:
        loss, noised, coins = gemma_block_diffusion_step(dump, params)
        # The canvas the model drew is the one recomputed here.
        if (noised.flatten().tolist() != dump["diffusion"]["noised"]
                or [int(c) for c in coins]
                != dump["diffusion"]["self_conditioning"]):
            print("FAIL: shardd's canvas or coins differ from the reference's")
            failures += 1
        clean = torch.tensor(dump["inputs"]).view(dump["batch"], -1)[
            :, -noised.shape[1]:]
        print(f"  canvas: {(noised != clean).sum().item()} of "
              f"{noised.numel()} tokens replaced, coins {coins}")
    else:
        loss = forward(dump, params, stats)
    loss.backward()

    # Bounds from the fp32 arithmetic (u = 2^-24) of the workers against
    # float64: each value passes through about L = 40 chained operations
    # (2 layers of norm, projections, rope, attention, router, experts, the
    # head), each a sum of at most n = 128 terms (hidden, head, vocab and
    # sequence sizes here), so the first-order worst case is L n u = 3e-4
    # relative, norm-wise, for every gradient; the loss is a mean of 48
    # cross-entropies, each within that bound.
    bound = 40 * 128 * 2.0 ** -24
    gemma = dump["architecture"] == "DiffusionGemmaForBlockDiffusion"
    if gemma:
        # DiffusionGemma's chain is longer: 3 layers of about 30 operations
        # (input norm, q/k/v projections and their 3 norms, RoPE, scores,
        # softmax, values, o_proj, post-attention norm, residual; the dense
        # branch's 2 norms and 3 products; the router's norm, scale, proj,
        # softmax and renormalisation; the experts' 2 norms, 2 products and
        # combine; the sum's norm, residual, layer_scalar) plus the head's 4
        # (final norm, logits, soft-cap, log-sum-exp): L = 100, n = 128.
        bound = 100 * 128 * 2.0 ** -24
    if diffusion:
        # The decode's stack reads the encode's keys and values, and its
        # input the self-conditioning decode's probabilities (itself a
        # decode on the encode): its chain continues both, L = 3 x 100.
        bound = 300 * 128 * 2.0 ** -24
    name_of = os.path.basename(config)
    rel = abs(dump["loss"] - loss.item()) / abs(loss.item())
    if diffusion:
        name_of += f" (block-diffusion step, response {response or 'one block'})"
    print(f"{name_of} ({dump['architecture']}): loss shardd {dump['loss']:.9f} "
          f"reference {loss.item():.9f} relative {rel:.2e} (bound {bound:.1e})")
    if not rel <= bound:
        failures += 1
    worst, worst_name = 0.0, ""
    for name in frozen:
        if name in dump["grads"]:
            print(f"FAIL {name}: frozen, yet shardd wrote a gradient")
            failures += 1
    for name, tensor in params.items():
        if name in frozen:
            continue
        want = tensor.grad.flatten()
        got = torch.tensor(dump["grads"][name])
        err = (got - want).norm().item() / max(want.norm().item(), 1e-30)
        if err > worst:
            worst, worst_name = err, name
        if not err <= bound:
            print(f"FAIL {name}: relative L2 error {err:.2e}")
            failures += 1
    print(f"  {len(params)} gradients, largest relative L2 error {worst:.2e} "
          f"({worst_name})")
    if stats.get("routed") and frozen:
        print(f"  e_score_correction_bias changed the experts of "
              f"{stats['bias_changed']} of {stats['routed']} routed tokens")
        if stats["bias_changed"] == 0:
            print("FAIL: the correction bias changed no selection")
            failures += 1
    if gemma and not diffusion:
        # The soft-cap must matter: without it the loss would miss by more
        # than 10 times the bound.
        with torch.no_grad():
            uncapped = gemma_forward(dump, params, softcap=False).item()
        share = abs(uncapped - loss.item()) / loss.item()
        print(f"  soft-cap {float(dump['dims']['final_logit_softcapping'])}: "
              f"the uncapped loss differs by {share:.2%}")
        if not share > 10 * bound:
            print("FAIL: the soft-cap is too weak to be checked")
            failures += 1
    if "aux" in stats:
        # The term must matter: without it the loss would miss by more
        # than 10 times its bound.
        coef = float(dump["dims"]["router_aux_loss_coef"])
        share = coef * stats["aux"] / loss.item()
        print(f"  load-balancing loss: aux {stats['aux']:.6f}, coef {coef}, "
              f"{share:.1%} of the loss")
        if not share > 10 * bound:
            print("FAIL: the load-balancing term is too small to be checked")
            failures += 1
    if gpt_oss:
        # The clamp must have cut values on both branches, or it went
        # unchecked.
        print(f"  clamped: {stats['gate_clamped']} gate and "
              f"{stats['up_clamped']} up values of {stats['values']} each")
        if stats["gate_clamped"] == 0 or stats["up_clamped"] == 0:
            print("FAIL: the swiglu clamp cut nothing")
            failures += 1
    return failures


def main():
    failures = sum(check(sys.argv[1], config) for config in sys.argv[2:])
    # One canvas block, then a 20-token response of 8-token blocks (8, 8, 4)
    # after a 4-token prompt: later blocks see earlier ones' clean tokens.
    for response in (0, 20):
        failures += sum(check(sys.argv[1], config, diffusion=True,
                              response=response)
                        for config in sys.argv[2:]
                        if "diffusion_gemma" in config)
    if failures:
        print(f"FAIL: {failures} checks out of bounds")
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
