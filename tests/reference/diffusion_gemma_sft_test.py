"""DiffusionGemma SFT (docs/sft_data.md, "DiffusionGemma") through the
daemons against Hugging Face transformers' own DiffusionGemmaForBlockDiffusion.

tools/prepare_sft.py prepares tests/data/tiny_chat (its manifest carries
the tokenizer's eos_id). The tiny model of tests/data/tiny_chat/
diffusion_gemma.json (tests/data/tiny_diffusion_gemma.json with 256
positions, which the conversations need) is redrawn as in
diffusion_gemma_test.py. `shardctl train --data DATASET` over 1 and 2 CPU
workers, and 2 workers with 2 micro-batches, lays out each row as NeMo
AutoModel's dLLM collator does: the prompt (the tokens before the first
counted one), the response padded with EOS to the 8-token blocks, padding.
The oracle is diffusion_gemma_oracle.sft_block_diffusion_loss on the
transformers model in float64 on the same rows: each row's canvas its own
response at positions prompt length + j, the block-causal mask with a
per-row prefix, the encoder CE over every next token of prompt + response +
EOS fill, the diffusion CE over the scored canvas tokens, each divided by
its count over the global batch. Step 1's loss and gradient norm must be
within diffusion_gemma_test's fp32 bound; the same oracle with the old
layout's fixed prefix (the canvas at the rows' tail), with the EOS fill
unscored, or with each term a mean over its own micro-batch must miss it.
The held-out loss after step 1 (--eval-data on the same dataset) must
equal the oracle's on shardd's exported weights. A response longer than
--response-length is refused naming the example and the flag, and 30
steps bring the loss down.

Usage: diffusion_gemma_sft_test.py BIN_DIR REPO_ROOT
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diffusion_gemma_oracle as dg  # noqa: E402
from diffusion_gemma_test import DG_FP32_BOUND  # noqa: E402
from sft_test import (Checks, epoch_order, prepare_tiny_chat,  # noqa: E402
                      read_dataset)
from shardd_cluster import BETAS, EPS, LR, WEIGHT_DECAY, Cluster  # noqa: E402
from transformers_test import gradient_norms, redraw  # noqa: E402

BATCH, SEED, BLOCK = 4, 5, 8


def layout(examples, eos, pad, seq, canvas):
    """worker/data/sft_source.h's DiffusionRows for every example: (inputs,
    encoder targets, response start, canvas targets); None when it does
    not fit."""
    out = []
    for tokens, mask, _ in examples:
        n = len(tokens)
        p = mask.index(1)
        r = -(-(n - p) // BLOCK) * BLOCK
        if p + r > seq or r > canvas:
            out.append(None)
            continue
        inputs = tokens + [eos] * (p + r - n) + [pad] * (seq - p - r)
        ar = [inputs[j + 1] if j + 1 < p + r else -1 for j in range(seq)]
        ct = [(-1 if j >= r else eos if p + j >= n
               else tokens[p + j] if mask[p + j] else -1)
              for j in range(canvas)]
        out.append((inputs, ar, p, ct))
    return out


def step_rows(rows, step, n):
    """Step `step`'s BATCH rows (sequence k holds example order[k mod N] of
    epoch k / N) as tensors, and their global indices."""
    idx = list(range(step * BATCH, (step + 1) * BATCH))
    chosen = [rows[epoch_order(n, SEED, k // n)[k % n]] for k in idx]
    return (torch.tensor([r[0] for r in chosen]),
            torch.tensor([r[1] for r in chosen]),
            [r[2] for r in chosen], torch.tensor([r[3] for r in chosen]),
            idx)


def events(run, kind):
    """The run's --json lines of `kind` ("step", "eval")."""
    return [json.loads(line) for line in run.stdout.splitlines()
            if line.startswith('{"event":"%s"' % kind)]


def steps_of(run):
    return [(x["loss"], x["grad_norm"]) for x in events(run, "step")]


def gap(got, want):
    """The larger relative difference of (loss, gradient norm)."""
    return max(abs(g - w) / w for g, w in zip(got, want))


def oracle_step1(model, rows, n, pad, micro=1, fixed_prefix=False,
                 trainable=None):
    """(loss, gradient norm) of step 1 on the transformers model. `micro`
    > 1 takes each term's mean over its own micro-batch (then averages
    them) instead of over the global batch; `fixed_prefix` places every
    canvas at the rows' tail as the non-SFT step does. `trainable`: a
    function of the model giving the gradients to measure (by default
    every parameter shardd trains)."""
    grads = None
    if trainable is None:
        params = dg.freeze(model)
    else:
        grads = trainable
    inputs, ar, starts, targets, idx = step_rows(rows, 0, n)
    s, c = inputs.shape[1], targets.shape[1]
    if fixed_prefix:
        starts = [s - c] * len(starts)
    size = BATCH // micro
    total = 0.0
    for m in range(micro):
        sl = slice(m * size, (m + 1) * size)
        counts = ((ar[sl] >= 0).sum().item(), (targets[sl] >= 0).sum().item())
        if micro == 1:
            counts = ((ar >= 0).sum().item(), (targets >= 0).sum().item())
        loss, _, _ = dg.sft_block_diffusion_loss(
            model, inputs[sl], ar[sl], starts[sl], targets[sl], 0, idx[sl],
            counts, pad)
        (loss / micro).backward()
        total += loss.item() / micro
    if grads is not None:
        return total, grads(model)
    return total, gradient_norms(params.values())[0]


ENCODER, DECODER = "model.encoder.language_model.layers.", "model.decoder.layers."


def lora_gradient_norm(scales):
    """The norm of the adapters' gradients as shardd's adapters have them:
    each encoder copy's added to its decoder twin's (transformers runs
    DiffusionGemma's one stack as two module trees, PEFT gives each its own
    copy of an adapter, shardd's one adapter gets both gradients); and the
    experts' down_proj B of the folded weight, as NeMo trains it (shardd's
    B[e] is PEFT's times per_expert_scale[e], so its gradient is PEFT's
    divided by it; `scales`: layer -> per_expert_scale)."""
    def norm(model):
        summed = {}
        for name, w in model.named_parameters():
            if "lora_" not in name or w.grad is None:
                continue
            g = w.grad
            # Live names: ...experts.lora_B.default.weight (down_proj's;
            # gate_up_proj's wrapper is experts.base_layer).
            if ".experts.lora_B." in name:
                pes = scales[name.split("layers.")[1].split(".")[0]]
                g = (g.view(g.shape[0], -1, pes.numel()) / pes).reshape(g.shape)
            key = name.replace(ENCODER, DECODER)
            summed[key] = summed.get(key, 0) + g
        return torch.sqrt(sum((g ** 2).sum() for g in summed.values())).item()
    return norm


def peft_dg(base, adapters):
    """transformers' DiffusionGemma of `base` (float64, eager) with PEFT's
    adapters, and what set_peft_model_state_dict left unmatched."""
    import peft
    model = dg.load(base)[0]
    model = peft.PeftModel.from_pretrained(model, adapters, is_trainable=True)
    result = peft.set_peft_model_state_dict(
        model, peft.utils.load_peft_weights(adapters))
    return model, result


def check_lora(cluster, check, work, repo, config_path, dataset, rows, n,
               pad, seq, canvas, train):
    """LoRA SFT (NeMo's other DiffusionGemma recipe) on a base whose
    per_expert_scale is not 1: fresh adapters start from the base's loss;
    the export (with --base) loads with PEFT onto transformers' model, both
    module trees adapted alike; a job resumed from base + adapters equals
    PEFT's model at step 1; adapters exported without dividing by
    per_expert_scale miss it."""
    import safetensors.torch
    base = os.path.join(work, "hf_scaled")
    model = transformers.DiffusionGemmaForBlockDiffusion._from_config(
        dg.config_with_vision(config_path), attn_implementation="eager",
        dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    redraw(model, gen)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("per_expert_scale"):
                w.copy_(0.5 + torch.rand(w.shape, generator=gen))
    model.save_pretrained(base)
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets",
            "q_proj,k_proj,v_proj,o_proj,gate_proj,experts"]
    def run(extra, steps=1):
        return train(["--response-length", str(canvas)] + extra, steps=steps,
                     model=base)

    want_base = oracle_step1(dg.load(base)[0], rows, n, pad)
    r = run(lora + ["--dp", "2", "--checkpoint-every", "2"], steps=2)
    got = steps_of(r)
    saved = [x["checkpoint"] for x in events(r, "step") if "checkpoint" in x]
    if len(got) != 2 or len(saved) != 1:
        check(False, f"LoRA: the job did not run:\n{r.stdout}\n{r.stderr}")
        return
    err = abs(got[0][0] - want_base[0]) / want_base[0]
    check(err <= DG_FP32_BOUND,
          f"LoRA: fresh adapters start from the base's loss ({got[0][0]:.9f} "
          f"vs {want_base[0]:.9f}, {err:.1e})")
    ckpt = os.path.join(cluster.checkpoints, saved[0])
    out = os.path.join(work, "adapters")
    r = subprocess.run([f"{cluster.bin}/client/shardctl", "checkpoint",
                        "export", "--checkpoint", ckpt, "--hf", out],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode != 0 and "--base" in r.stderr and
          not os.path.exists(out),
          f"LoRA: the export without --base is refused naming it "
          f"({r.stderr.strip()[-160:]})")
    cluster.shardctl_local(["checkpoint", "export", "--checkpoint", ckpt,
                            "--hf", out, "--base", base])
    peft_model, result = peft_dg(base, out)
    trained = [k for k, _ in peft_model.named_parameters() if "lora_" in k]
    check(not result.unexpected_keys and not
          [k for k in result.missing_keys if "lora_" in k] and
          any(k.startswith("base_model.model." + ENCODER) for k in trained),
          f"LoRA: PEFT loads the export ({len(trained)} adapter tensors, the "
          "encoder's and the decoder's module trees; no key missing or left "
          "over)")
    weights = safetensors.torch.load_file(
        os.path.join(base, "model.safetensors"))
    scales = {k.split("layers.")[1].split(".")[0]: v.double()
              for k, v in weights.items()
              if k.startswith(DECODER) and k.endswith("per_expert_scale")}
    want = oracle_step1(peft_model, rows, n, pad,
                        trainable=lora_gradient_norm(scales))
    # Deliberate error: B of the experts' down_proj not divided by
    # per_expert_scale.
    wrong_dir = os.path.join(work, "adapters_unscaled")
    shutil.copytree(out, wrong_dir)
    tensors = safetensors.torch.load_file(
        os.path.join(out, "adapter_model.safetensors"))
    for key, t in tensors.items():
        if key.endswith("experts.lora_B.weight"):
            pes = scales[key.split("layers.")[1].split(".")[0]].float()
            e = pes.numel()
            tensors[key] = (t.view(t.shape[0], -1, e) * pes).reshape(t.shape)
    safetensors.torch.save_file(
        tensors, os.path.join(wrong_dir, "adapter_model.safetensors"),
        metadata={"format": "pt"})
    wrong = oracle_step1(peft_dg(base, wrong_dir)[0], rows, n, pad,
                         trainable=lora_gradient_norm(scales))
    for world in (1, 2):
        r = run(lora + ["--dp", str(world), "--lora-from", out])
        got = steps_of(r)
        if len(got) != 1:
            check(False, f"LoRA resume: no step\n{r.stdout}\n{r.stderr}")
            continue
        (gl, gn), (wl, wn) = got[0], want
        err = gap(got[0], want)
        check(err <= DG_FP32_BOUND,
              f"LoRA: base + exported adapters at {world} worker(s): step 1's "
              f"loss {gl:.9f} and adapter gradient norm {gn:.9f} within "
              f"{err:.2e} of PEFT's ({wl:.9f}, {wn:.9f}; bound "
              f"{DG_FP32_BOUND:.1e})")
        if world == 2:
            away = gap(got[0], wrong)
            check(away > DG_FP32_BOUND,
                  f"LoRA: adapters not divided by per_expert_scale are "
                  f"{away:.2e} away (outside the bound)")


def main():
    bin_dir, repo = sys.argv[1], sys.argv[2]
    check = Checks()
    with tempfile.TemporaryDirectory() as work:
        dataset, run = prepare_tiny_chat(repo, work)
        check(run.returncode == 0, "prepare_sft.py prepares tiny_chat")
        manifest = json.load(open(os.path.join(dataset, "shardd_sft.json")))
        pad, eos = manifest["pad_id"], manifest["eos_id"]
        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.join(repo, "tests/data/tiny_chat"))
        check(eos == tok.eos_token_id,
              f"the manifest's eos_id is the tokenizer's ({eos})")
        examples = read_dataset(dataset)
        n = len(examples)
        prompts = [mask.index(1) for _, mask, _ in examples]
        responses = [-(-(len(t) - p) // BLOCK) * BLOCK
                     for (t, _, _), p in zip(examples, prompts)]
        seq = max(p + r for p, r in zip(prompts, responses))
        canvas = max(responses)
        print(f"{n} examples: prompts {min(prompts)}..{max(prompts)} tokens, "
              f"responses padded to {min(responses)}..{canvas}; --seq {seq} "
              f"--response-length {canvas}")

        config_path = os.path.join(repo, "tests/data/tiny_chat/"
                                   "diffusion_gemma.json")
        hf_dir = os.path.join(work, "hf")
        model = transformers.DiffusionGemmaForBlockDiffusion._from_config(
            dg.config_with_vision(config_path), attn_implementation="eager",
            dtype=torch.float32)
        redraw(model, torch.Generator().manual_seed(5))
        with torch.no_grad():
            for name, w in model.named_parameters():
                if name.endswith("per_expert_scale"):
                    w.fill_(1.0)
        model.save_pretrained(hf_dir)

        rows = layout(examples, eos, pad, seq, canvas)
        want = oracle_step1(dg.load(hf_dir)[0], rows, n, pad)
        wrong = {
            "the canvas at the rows' tail (one prefix for all)":
                oracle_step1(dg.load(hf_dir)[0], rows, n, pad,
                             fixed_prefix=True),
            "each term a mean over its micro-batch":
                oracle_step1(dg.load(hf_dir)[0], rows, n, pad, micro=2),
            "the EOS fill unscored": oracle_step1(
                dg.load(hf_dir)[0],
                [(i, a, p, [-1 if t == eos and j >= len(examples[e][0]) - p
                            else t for j, t in enumerate(ct)])
                 for e, (i, a, p, ct) in enumerate(rows)], n, pad),
        }
        print("transformers' step 1:", want)

        def train(extra, steps=1, lr=LR, model=None):
            model = model or hf_dir
            return cluster.shardctl(
                ["train", "--model", model, "--init-from", model, "--data",
                 dataset, "--seed", str(SEED), "--steps", str(steps),
                 "--global-batch", str(BATCH), "--seq", str(seq), "--lr",
                 str(lr), "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
                 "--eps", str(EPS), "--weight-decay", str(WEIGHT_DECAY),
                 "--grad-clip", "0", "--no-mixed-precision", "--json"]
                + extra, check=False)


        cluster = Cluster(bin_dir, work)
        try:
            for world, micro in ((1, 1), (2, 1), (2, 2)):
                r = train(["--dp", str(world), "--microbatches", str(micro),
                           "--response-length", str(canvas)])
                got = steps_of(r)
                if len(got) != 1:
                    check(False, f"{world} worker(s): no step\n{r.stdout}"
                                 f"\n{r.stderr}")
                    continue
                (gl, gn) = got[0]
                err = gap(got[0], want)
                check(err <= DG_FP32_BOUND,
                      f"{world} worker(s), {micro} micro-batch(es): step 1's "
                      f"loss {gl:.9f} and gradient norm {gn:.9f} within "
                      f"{err:.2e} of transformers' (bound {DG_FP32_BOUND:.1e})")
                if world == 2 and micro == 2:
                    for what, bad in wrong.items():
                        away = gap(got[0], bad)
                        check(away > DG_FP32_BOUND,
                              f"the oracle with {what} is {away:.2e} away "
                              "(outside the bound)")
            # The held-out loss after step 1 (the evaluation reads the same
            # dataset from its start: step 0's rows and noise) against the
            # oracle on shardd's exported weights after that step.
            r = train(["--dp", "2", "--response-length", str(canvas),
                       "--eval-data", dataset, "--eval-batches", "1",
                       "--checkpoint-every", "1"])
            saved = [x["checkpoint"] for x in events(r, "step")
                     if "checkpoint" in x]
            evals = [x["eval_loss"] for x in events(r, "eval")]
            if len(saved) != 1 or len(evals) != 1:
                check(False, f"no checkpoint or evaluation:\n{r.stdout}\n"
                             f"{r.stderr}")
            else:
                out = os.path.join(work, "after1")
                cluster.shardctl_local([
                    "checkpoint", "export", "--checkpoint",
                    os.path.join(cluster.checkpoints, saved[0]), "--hf", out])
                after, _ = oracle_step1(dg.load(out)[0], rows, n, pad)
                err = abs(evals[0] - after) / after
                check(err <= DG_FP32_BOUND,
                      f"2 workers: the held-out loss after step 1, "
                      f"{evals[0]:.9f}, within {err:.2e} of transformers' on "
                      f"the exported weights ({after:.9f})")
            r = train(["--dp", "1", "--response-length", str(canvas - BLOCK)])
            check(r.returncode != 0 and "raise --response-length" in r.stderr
                  and "(line " in r.stderr,
                  "a response longer than --response-length is refused "
                  f"naming the example: {r.stderr.strip()[-300:]}")
            r = train(["--dp", "2", "--response-length", str(canvas)],
                      steps=30, lr=0.01)
            curve = [loss for loss, _ in steps_of(r)]
            first = sum(curve[:3]) / 3 if curve else 0
            last = sum(curve[-3:]) / 3 if curve else 0
            check(len(curve) == 30 and last < 0.75 * first,
                  f"30 steps at lr 0.01: loss (mean of 3) {first:.3f} -> "
                  f"{last:.3f}")
            check_lora(cluster, check, work, repo, config_path, dataset, rows,
                       n, pad, seq, canvas, train)
        finally:
            cluster.stop()
    print(f"{check.failures} failure(s)")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
