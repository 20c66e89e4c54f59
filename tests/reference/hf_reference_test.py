"""DiffusionGemma's CPU model step against a plain-PyTorch reference.

The other architectures are checked against Hugging Face transformers itself
(transformers_test.py). DiffusionGemma's block-diffusion training step (the
noise, the self-conditioning coins, the three passes) is shardd's recipe,
which transformers does not define, so its reference stays written here
(gemma_reference.py), from modeling_diffusion_gemma.py.

model_dump runs one training step of shardd's CPU model on random fp32
weights and writes the weights, tokens, loss and gradients. This test
recomputes the step in float64: first the causal pass over clean tokens
that its training runs first (DiffusionGemmaEncoderTextModel), by
gemma_forward(): the embedding times sqrt(hidden); per layer
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
(unused by this pass) get no gradient. Then the 3-pass block-diffusion step
(gemma_block_diffusion_step).

Usage: hf_reference_test.py MODEL_DUMP CONFIG.json [CONFIG.json ...]
"""

import json
import os
import subprocess
import sys
import tempfile

import torch

torch.set_default_dtype(torch.float64)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemma_reference import (gemma_block_diffusion_step,  # noqa: E402
                             gemma_forward)


def forward(dump, p, stats=None):
    """The causal pass's mean loss."""
    return gemma_forward(dump, p)


def check(dump_binary, config, diffusion=False, response=0):
    """Returns the number of checks out of bounds for one config; with
    `diffusion`, of DiffusionGemma's 3-pass block-diffusion step (its canvas
    the last `response` tokens, 0: one block of canvas_length)."""
    extra = []
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
    # Frozen parameters (DiffusionGemma's router and layer_scalar) get no
    # gradient, here as in shardd; neither does DiffusionGemma's self_conditioning, which the
    # causal pass never reads.
    frozen = {name for name in dump["params"]
              if name.endswith(("moe.gate.scale",
                                "moe.gate.proj.weight", "layer_scalar"))
              or (name.startswith("model.self_conditioning.")
                  and not diffusion)}
    params = {
        name: torch.tensor(t["values"]).view(t["shape"]).requires_grad_(
            name not in frozen)
        for name, t in dump["params"].items()
    }
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
        loss = forward(dump, params)
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
