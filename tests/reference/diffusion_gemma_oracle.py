"""DiffusionGemma's block-diffusion training step on Hugging Face transformers'
own DiffusionGemmaForBlockDiffusion (modeling_diffusion_gemma.py).

transformers defines the model (its encoder, the decoder that reads the
encoder's K/V, the self-conditioning block, the soft-capped head) but not
the training step; NeMo AutoModel's recipe, which shardd runs
(docs/model-spec.md), is composed here from the model's own forward:

1. the causal encode over the whole sequence (the encoder's K/V go into a
   cache; its hidden states give the autoregressive loss);
2. a no-grad decode of the noised canvas, with no self-conditioning signal;
3. the decode again, self-conditioned on step 2's logits for the sequences
   whose coin says so, over [encoder K/V ; canvas K/V] under the
   block-causal training mask, which is passed to the model as its
   per-layer-type `decoder_attention_mask`;

loss = diffusion_loss_weight x CE(decode, clean canvas) + encoder_loss_weight
x CE(encode, next tokens). The noise (D3PM-uniform) and the coins come from
shardd's own SplitMix64, keyed by (optimizer step, global sequence index),
recomputed here in Python integers.
"""

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache

from transformers_test import load_config

# DiffusionGemma's encoder is multimodal: transformers builds a vision tower
# from vision_config. shardd trains the text stack and skips the tower's
# tensors; this tiny one only lets transformers build the model.
TINY_VISION_CONFIG = {
    "model_type": "gemma4_vision", "hidden_size": 16,
    "intermediate_size": 32, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8,
    "num_hidden_layers": 1, "patch_size": 4, "pooling_kernel_size": 1,
    "position_embedding_size": 16}

# Parameters shardd keeps frozen (the router) or does not have (the vision
# tower; per_expert_scale, which it folds into the down weights: 1 here).
FROZEN = ("router.proj.weight", "router.scale", "router.per_expert_scale")


def config_with_vision(path):
    """transformers' config for a DiffusionGemma config.json, with the tiny
    vision tower when it has none."""
    return load_config(path, {"vision_config": TINY_VISION_CONFIG})


def is_text(name):
    return "vision" not in name


def freeze(model):
    """Marks the parameters shardd does not train; returns the trainable
    ones by name."""
    trainable = {}
    for name, w in model.named_parameters():
        w.requires_grad_(is_text(name) and not name.endswith(FROZEN))
        if w.requires_grad:
            trainable[name] = w
    return trainable


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


def diffusion_canvas(step, sequence_indices, tokens, canvas, vocab):
    """The noised canvas [B, canvas] and the coins (docs/model-spec.md:
    D3PM-uniform, t = eps + (1 - eps) u per sequence, then u and a token per
    position; keys (step, global sequence index), domains 16 and 17)."""
    noised, coins = [], []
    for row, index in enumerate(sequence_indices):
        rng = SplitMix64(step, 16, index)
        level = 1e-3 + (1 - 1e-3) * rng.double()
        for j in range(canvas):
            clean = int(tokens[row, -canvas + j])
            u, token = rng.double(), rng.below(vocab)
            noised.append(token if u < level else clean)
        coins.append(SplitMix64(step, 17, index).double() < 0.5)
    return torch.tensor(noised).view(len(coins), canvas), coins


def training_masks(text, s, r, block_len, dtype):
    """{layer type: additive mask [1, 1, r, s + r]} over keys [encoder
    0..s-1 ; canvas 0..r-1]: canvas query j (block j // L) sees an encoder
    key in the prompt or an earlier response block (sliding layers: only
    from prefix + block * L - W + 1 on) and the canvas keys of its own
    block."""
    prefix = s - r
    window = text.sliding_window
    j = torch.arange(r)[:, None]
    block = j // block_len
    key = torch.arange(s + r)[None, :]
    enc = key < s
    enc_ok = enc & ((key < prefix) | ((key - prefix) // block_len < block))
    canvas_ok = ~enc & ((key - s) // block_len == block)
    full = enc_ok | canvas_ok
    slide = ((enc_ok & (key >= prefix + block * block_len - window + 1))
             | canvas_ok)

    def additive(allowed):
        return torch.where(allowed, 0.0, float("-inf")).to(dtype)[None, None]
    return {"full_attention": additive(full),
            "sliding_attention": additive(slide)}


def softcapped(model, hidden):
    cap = model.final_logit_softcapping
    return cap * torch.tanh(model.lm_head(hidden) / cap)


def self_conditioned_decode(model, tokens, noised, masks, positions, coins):
    """The encode and the two decodes (the first without gradients, its
    logits the second's self-conditioning signal where the coin says so);
    the model's output of the second."""
    def run(self_conditioning_logits=None):
        # A cache of full layers: the training mask, not a sliding cache,
        # decides which encoder keys a sliding layer sees.
        return model(input_ids=tokens, past_key_values=DynamicCache(),
                     use_cache=True, decoder_input_ids=noised,
                     decoder_attention_mask=masks,
                     decoder_position_ids=positions,
                     self_conditioning_logits=self_conditioning_logits,
                     self_conditioning_mask=(
                         None if self_conditioning_logits is None
                         else torch.tensor(coins)))
    with torch.no_grad():
        first = run().logits
    return run(first.to(model.lm_head.weight.dtype))


def block_diffusion_loss(model, tokens, step, sequence_indices,
                         response_length=0, loss_weights=(1.0, 1.0)):
    """NeMo AutoModel's block-diffusion training loss on transformers'
    model, for tokens [B, S]: the canvas is the last `response_length`
    tokens (0: one block of canvas_length) in blocks of canvas_length.
    Returns (loss, noised canvas, coins)."""
    text = model.config.text_config
    b, s = tokens.shape
    block_len = int(model.config.canvas_length)
    r = response_length or block_len
    noised, coins = diffusion_canvas(step, sequence_indices, tokens, r,
                                     text.vocab_size)
    dtype = model.lm_head.weight.dtype
    masks = training_masks(text, s, r, block_len, dtype)
    positions = (s - r + torch.arange(r))[None, :].expand(b, r)
    out = self_conditioned_decode(model, tokens, noised, masks, positions,
                                  coins)
    diffusion = F.cross_entropy(out.logits.flatten(0, 1).to(dtype),
                                tokens[:, s - r:].flatten())
    enc_logits = softcapped(model, out.encoder_last_hidden_state)
    ar = F.cross_entropy(enc_logits[:, :-1].flatten(0, 1),
                         tokens[:, 1:].flatten())
    return loss_weights[1] * diffusion + loss_weights[0] * ar, noised, coins


def load(directory, dtype=torch.float64):
    """transformers' DiffusionGemmaForBlockDiffusion from a directory
    (eager attention and experts), with from_pretrained's report of unmatched keys."""
    return transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)



def sft_canvas(step, sequence_indices, inputs, starts, targets, vocab, pad):
    """SFT rows' noised canvas [B, C] and coins: row b's canvas is its own
    response from starts[b] on; only the positions with a target (>= 0)
    are noised, with the same draws as diffusion_canvas."""
    b, s = inputs.shape
    c = targets.shape[1]
    noised, coins = [], []
    for row, index in enumerate(sequence_indices):
        rng = SplitMix64(step, 16, index)
        level = 1e-3 + (1 - 1e-3) * rng.double()
        for j in range(c):
            target = int(targets[row, j])
            p = int(starts[row]) + j
            clean = target if target >= 0 else (
                int(inputs[row, p]) if p < s else pad)
            u, token = rng.double(), rng.below(vocab)
            noised.append(token if target >= 0 and u < level else clean)
        coins.append(SplitMix64(step, 17, index).double() < 0.5)
    return torch.tensor(noised).view(b, c), coins


def sft_training_masks(text, s, starts, c, block_len, dtype):
    """{layer type: additive mask [B, 1, c, s + c]}: row b's canvas query j
    (block start j0 = j // L * L) sees the encoder keys before
    min(starts[b] + j0, s) (sliding layers: from starts[b] + j0 - W + 1
    on) and the canvas keys of its own block (NeMo AutoModel's
    build_block_diffusion_training_mask with a per-example prefix)."""
    window = text.sliding_window
    p = torch.as_tensor(starts)[:, None, None]
    j = torch.arange(c)[None, :, None]
    j0 = j // block_len * block_len
    key = torch.arange(s + c)[None, None, :]
    enc = key < s
    end = torch.clamp(p + j0, max=s)
    enc_ok = enc & (key < end)
    canvas_ok = ~enc & ((key - s) // block_len == j // block_len)
    full = enc_ok | canvas_ok
    slide = (enc_ok & (key >= p + j0 - window + 1)) | canvas_ok

    def additive(allowed):
        return torch.where(allowed, 0.0, float("-inf")).to(dtype)[:, None]
    return {"full_attention": additive(full),
            "sliding_attention": additive(slide)}


def sft_block_diffusion_loss(model, inputs, ar_targets, starts, targets, step,
                             sequence_indices, counts, pad,
                             loss_weights=(1.0, 1.0), masks_fn=None):
    """NeMo AutoModel's DiffusionGemma SFT loss on transformers' model for
    SFT rows (docs/sft_data.md): inputs [B, S] (prompt, response, EOS fill,
    padding), the encoder's targets [B, S] (-1: none), each row's response
    start and canvas targets [B, C] (-1: not scored). Each term is its
    cross-entropy summed over its scored tokens and divided by its count
    over the global batch (`counts` = (encoder, canvas)). Returns (loss,
    noised canvas, coins)."""
    text = model.config.text_config
    b, s = inputs.shape
    c = targets.shape[1]
    block_len = int(model.config.canvas_length)
    noised, coins = sft_canvas(step, sequence_indices, inputs, starts,
                               targets, text.vocab_size, pad)
    dtype = model.lm_head.weight.dtype
    masks = (masks_fn or sft_training_masks)(text, s, starts, c, block_len,
                                             dtype)
    positions = torch.clamp(torch.as_tensor(starts)[:, None]
                            + torch.arange(c)[None, :], max=s - 1)
    out = self_conditioned_decode(model, inputs, noised, masks, positions,
                                  coins)
    diffusion = F.cross_entropy(out.logits.flatten(0, 1).to(dtype),
                                targets.flatten(), ignore_index=-1,
                                reduction="sum") / counts[1]
    enc_logits = softcapped(model, out.encoder_last_hidden_state)
    ar = F.cross_entropy(enc_logits.flatten(0, 1), ar_targets.flatten(),
                         ignore_index=-1, reduction="sum") / counts[0]
    return loss_weights[1] * diffusion + loss_weights[0] * ar, noised, coins
