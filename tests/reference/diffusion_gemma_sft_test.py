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


def oracle_step1(model, rows, n, pad, micro=1, fixed_prefix=False):
    """(loss, gradient norm) of step 1 on the transformers model. `micro`
    > 1 takes each term's mean over its own micro-batch (then averages
    them) instead of over the global batch; `fixed_prefix` places every
    canvas at the rows' tail as the non-SFT step does."""
    trainable = dg.freeze(model)
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
    return total, gradient_norms(trainable.values())[0]


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

        def train(extra, steps=1, lr=LR):
            return cluster.shardctl(
                ["train", "--model", hf_dir, "--init-from", hf_dir, "--data",
                 dataset, "--seed", str(SEED), "--steps", str(steps),
                 "--global-batch", str(BATCH), "--seq", str(seq), "--lr",
                 str(lr), "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
                 "--eps", str(EPS), "--weight-decay", str(WEIGHT_DECAY),
                 "--grad-clip", "0", "--no-mixed-precision", "--json"]
                + extra, check=False)

        def steps_of(r):
            return [(x["loss"], x["grad_norm"]) for x in
                    (json.loads(line) for line in r.stdout.splitlines()
                     if line.startswith('{"event":"step"'))]

        def events(r, kind):
            return [json.loads(line) for line in r.stdout.splitlines()
                    if line.startswith('{"event":"%s"' % kind)]

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
                (gl, gn), (wl, wn) = got[0], want
                err = max(abs(gl - wl) / wl, abs(gn - wn) / wn)
                check(err <= DG_FP32_BOUND,
                      f"{world} worker(s), {micro} micro-batch(es): step 1's "
                      f"loss {gl:.9f} and gradient norm {gn:.9f} within "
                      f"{err:.2e} of transformers' (bound {DG_FP32_BOUND:.1e})")
                if world == 2 and micro == 2:
                    for what, (bl, bn) in wrong.items():
                        away = max(abs(gl - bl) / bl, abs(gn - bn) / bn)
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
        finally:
            cluster.stop()
    print(f"{check.failures} failure(s)")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
