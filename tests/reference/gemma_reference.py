"""DiffusionGemma in float64 PyTorch, for hf_reference_test.py and
train_reference_test.py: the shared decoder stack as Hugging Face's
modeling_diffusion_gemma.py computes it (gemma_forward: one causal pass), and
NeMo AutoModel's block-diffusion training step (gemma_block_diffusion_step:
the causal encode, the no-grad self-conditioning decode, the decode over
[encoder K/V ; canvas K/V] under the block-causal training mask; the noise
from its own SplitMix64, docs/model-spec.md).
"""

import torch

torch.set_default_dtype(torch.float64)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def gemma_rms_norm(x, weight, eps):
    """DiffusionGemmaRMSNorm: x * (mean(x^2) + eps)^-0.5 (* weight)."""
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if weight is None else y * weight


def gemma_inv_freq(rope_spec, head_dim):
    """The default and proportional frequencies (modeling_rope_utils)."""
    theta = rope_spec["theta"]
    if rope_spec.get("type") == "proportional":
        rotated = int(rope_spec.get("partial_rotary_factor", 1.0) * head_dim
                      // 2)
        inv = torch.zeros(head_dim // 2)
        inv[:rotated] = 1.0 / theta ** (
            torch.arange(0, 2 * rotated, 2) / head_dim)
        return inv
    return 1.0 / theta ** (torch.arange(0, head_dim, 2) / head_dim)


def gemma_rope(x, positions, rope_spec, head_dim):
    # fp32 frequencies and angles, as HF's rotary embedding computes them.
    freqs = (positions.float()[:, None]
             * gemma_inv_freq(rope_spec, head_dim).float()[None, :]).double()
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def gemma_stack(dump, p, x, positions, masks, encoder_kv=None):
    """The shared decoder stack over x [b, t, D] at `positions` [t]; masks:
    (sliding, full) additive masks [t, keys]. With encoder_kv (a decode),
    each layer's keys and values are [encoder's ; its own] on the key axis.
    Returns the final norm's output and each layer's (k, v) after k_norm and
    RoPE / v_norm, [b, hkv, t, hd]."""
    d = dump["dims"]
    attention = d["attention"]
    b, t = x.shape[0], x.shape[1]
    eps = d["rms_norm_eps"]
    hidden = int(d["hidden_size"])
    hq = int(d["num_attention_heads"])
    top_k = int(d["top_k"])
    gelu = lambda g: torch.nn.functional.gelu(g, approximate="tanh")
    kv = []
    for layer, is_sliding in enumerate(attention["sliding_layers"]):
        pre = f"model.layers.{layer}."
        a = pre + "self_attn."
        if is_sliding:
            hd, hkv = int(d["head_dim"]), int(d["num_key_value_heads"])
            rope_spec = attention["sliding_rope"]
        else:
            hd = int(attention["global_head_dim"])
            hkv = int(attention["num_global_key_value_heads"])
            rope_spec = attention["rope"]
        residual = x
        h = gemma_rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = (h @ p[a + "q_proj.weight"].T).view(b, t, hq, hd)
        k = (h @ p[a + "k_proj.weight"].T).view(b, t, hkv, hd)
        v = ((h @ p[a + "v_proj.weight"].T).view(b, t, hkv, hd)
             if a + "v_proj.weight" in p else k)
        q = gemma_rms_norm(q, p[a + "q_norm.weight"], eps).transpose(1, 2)
        k = gemma_rms_norm(k, p[a + "k_norm.weight"], eps).transpose(1, 2)
        v = gemma_rms_norm(v, None, eps).transpose(1, 2)
        q = gemma_rope(q, positions, rope_spec, hd)
        k = gemma_rope(k, positions, rope_spec, hd)
        kv.append((k, v))
        if encoder_kv is not None:
            k = torch.cat((encoder_kv[layer][0], k), dim=2)
            v = torch.cat((encoder_kv[layer][1], v), dim=2)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = q @ k.transpose(-1, -2) * 1.0 + masks[0 if is_sliding else 1]
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
        out = out.reshape(b, t, hq * hd) @ p[a + "o_proj.weight"].T
        x = residual + gemma_rms_norm(
            out, p[pre + "post_attention_layernorm.weight"], eps)
        residual = x
        h = gemma_rms_norm(x, p[pre + "pre_feedforward_layernorm.weight"], eps)
        m = pre + "mlp."
        h = (gelu(h @ p[m + "gate_proj.weight"].T) * (h @ p[m + "up_proj.weight"].T)
             ) @ p[m + "down_proj.weight"].T
        h1 = gemma_rms_norm(h, p[pre + "post_feedforward_layernorm_1.weight"],
                            eps)
        r = gemma_rms_norm(residual, None, eps)
        r = r * p[pre + "moe.gate.scale"] * hidden ** -0.5
        probs = torch.softmax(r @ p[pre + "moe.gate.proj.weight"].T, dim=-1)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        e_in = gemma_rms_norm(residual,
                              p[pre + "pre_feedforward_layernorm_2.weight"], eps)
        w_gu = p[pre + "moe.experts.gate_and_up_projs"]  # [E, D, 2I]
        w_d = p[pre + "moe.experts.down_projs"]  # [E, I, D]
        inter = w_d.shape[1]
        h2 = torch.zeros_like(e_in)
        for slot in range(top_k):
            e = chosen[..., slot]
            gu = torch.einsum("bsd,bsdf->bsf", e_in, w_gu[e])
            act = gelu(gu[..., :inter]) * gu[..., inter:]
            h2 = h2 + weights[..., slot : slot + 1] * torch.einsum(
                "bsi,bsid->bsd", act, w_d[e])
        h2 = gemma_rms_norm(h2, p[pre + "post_feedforward_layernorm_2.weight"],
                            eps)
        x = residual + gemma_rms_norm(
            h1 + h2, p[pre + "post_feedforward_layernorm.weight"], eps)
        x = x * p[pre + "layer_scalar"]
    return gemma_rms_norm(x, p["model.norm.weight"], eps), kv


def gemma_logits(dump, p, h, softcap=True):
    logits = h @ p["model.embed_tokens.weight"].T
    cap = float(dump["dims"]["final_logit_softcapping"])
    if softcap and cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def gemma_causal_masks(dump, s):
    positions = torch.arange(s)
    causal = torch.full((s, s), float("-inf")).triu(1)
    window = int(dump["dims"]["attention"]["sliding_window"])
    sliding = torch.where(positions[:, None] - positions[None, :] >= window,
                          float("-inf"), 0.0) + causal
    return sliding, causal


def gemma_forward(dump, p, softcap=True):
    """DiffusionGemma's causal pass and mean cross-entropy, float64."""
    b, s = dump["batch"], dump["seq"]
    hidden = int(dump["dims"]["hidden_size"])
    tokens = torch.tensor(dump["inputs"]).view(b, s)
    x = p["model.embed_tokens.weight"][tokens] * hidden ** 0.5
    h, _ = gemma_stack(dump, p, x, torch.arange(s), gemma_causal_masks(dump, s))
    logits = gemma_logits(dump, p, h, softcap)
    targets = torch.tensor(dump["targets"])
    return torch.nn.functional.cross_entropy(logits.view(b * s, -1), targets)


MASK64 = (1 << 64) - 1


def mix64(z):
    """worker/data/rng.h's Mix64 (SplitMix64's output function)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class SplitMix64:
    """worker/data/rng.h's StreamSeed and SplitMix64, in Python integers."""

    def __init__(self, seed, domain, index):
        h = mix64((seed + 0x9E3779B97F4A7C15 * (domain + 1)) & MASK64)
        self.state = mix64(h ^ mix64((index + 0xD1B54A32D192ED03) & MASK64))

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        return mix64(self.state)

    def double(self):
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)

    def below(self, n):
        return (self.next() * n) >> 64


def diffusion_canvas(dump, tokens, canvas):
    """The noised canvas and the coins (docs/model-spec.md: D3PM-uniform,
    t = eps + (1 - eps) u per sequence, then u and a token per position;
    keys (step, global sequence index), domains 16 and 17)."""
    step = dump["diffusion"]["step"]
    vocab = int(dump["dims"]["vocab_size"])
    noised, coins = [], []
    for row, index in enumerate(dump["diffusion"]["sequence_indices"]):
        rng = SplitMix64(step, 16, index)
        level = 1e-3 + (1 - 1e-3) * rng.double()
        for j in range(canvas):
            clean = int(tokens[row, -canvas + j])
            u, token = rng.double(), rng.below(vocab)
            noised.append(token if u < level else clean)
        coins.append(SplitMix64(step, 17, index).double() < 0.5)
    return torch.tensor(noised).view(len(coins), canvas), coins


def gemma_block_diffusion_step(dump, p):
    """NeMo AutoModel's block-diffusion training step (docs/model-spec.md),
    float64: the causal encode with its K/V and AR loss, the no-grad
    self-conditioning decode, the decode over [encoder K/V ; canvas K/V]
    under the block-causal training mask; diffusion_loss_weight x diffusion
    CE + encoder_loss_weight x AR CE (both 1.0 unless the dump's
    "diffusion" names them)."""
    d = dump["dims"]
    b, s = dump["batch"], dump["seq"]
    eps = d["rms_norm_eps"]
    hidden = int(d["hidden_size"])
    table = p["model.embed_tokens.weight"]
    # The canvas is the last r tokens (the response) in blocks of `block`
    # (canvas_length); the rest is the prompt.
    block_len = int(dump["diffusion"]["canvas_length"])
    r = int(dump["diffusion"].get("response_length") or block_len)
    prefix = s - r
    tokens = torch.tensor(dump["inputs"]).view(b, s)
    # 1. Encode.
    h, encoder_kv = gemma_stack(dump, p, table[tokens] * hidden ** 0.5,
                                torch.arange(s), gemma_causal_masks(dump, s))
    enc_logits = gemma_logits(dump, p, h)
    ar = torch.nn.functional.cross_entropy(
        enc_logits[:, :-1].reshape(-1, enc_logits.shape[-1]),
        tokens[:, 1:].reshape(-1))
    # The training mask over keys [encoder 0..S-1 ; canvas 0..R-1] for
    # canvas query j in block j // L: an encoder key when prompt or in an
    # earlier response block (and, sliding, >= P + block * L - W + 1); a
    # canvas key in the query's block.
    window = int(d["attention"]["sliding_window"])
    j = torch.arange(r)[:, None]
    block = j // block_len
    key = torch.arange(s + r)[None, :]
    enc = key < s
    enc_ok = enc & ((key < prefix) | ((key - prefix) // block_len < block))
    canvas_ok = ~enc & ((key - s) // block_len == block)
    full = enc_ok | canvas_ok
    slide = ((enc_ok & (key >= prefix + block * block_len - window + 1))
             | canvas_ok)
    ninf = float("-inf")
    masks = (torch.where(slide, 0.0, ninf), torch.where(full, 0.0, ninf))
    positions = prefix + torch.arange(r)
    noised, coins = diffusion_canvas(dump, tokens, r)
    e = table[noised] * hidden ** 0.5
    sc = "model.self_conditioning."
    # 2. Self-conditioning decode: zero signal, so the input is post_norm(e).
    with torch.no_grad():
        h1, _ = gemma_stack(dump, p, gemma_rms_norm(e, None, eps), positions,
                            masks, encoder_kv)
        probs = torch.softmax(gemma_logits(dump, p, h1), dim=-1)
    # 3. Decode.
    signal = (probs @ table) * hidden ** 0.5
    signal = signal * torch.tensor(coins, dtype=signal.dtype)[:, None, None]
    pre = gemma_rms_norm(signal, p[sc + "pre_norm.weight"], eps)
    gelu = lambda g: torch.nn.functional.gelu(g, approximate="tanh")
    mlp = (gelu(pre @ p[sc + "gate_proj.weight"].T)
           * (pre @ p[sc + "up_proj.weight"].T)) @ p[sc + "down_proj.weight"].T
    h2, _ = gemma_stack(dump, p, gemma_rms_norm(e + mlp, None, eps), positions,
                        masks, encoder_kv)
    logits = gemma_logits(dump, p, h2)
    diffusion = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, prefix:].reshape(-1))
    weights = dump["diffusion"]
    return (weights.get("diffusion_loss_weight", 1.0) * diffusion
            + weights.get("encoder_loss_weight", 1.0) * ar, noised, coins)
