"""DiffusionGemma's first AdamW steps of block-diffusion training, started
from Hugging Face safetensors, against PyTorch.

The other architectures train against Hugging Face transformers itself
(transformers_test.py); DiffusionGemma's 3-pass block-diffusion step is
shardd's recipe, which transformers does not define, so its reference is
written here (gemma_reference.py).

For each tiny config: model_dump draws random fp32 weights (shardd names),
this test writes them as a Hugging Face checkpoint under the released
tensor names and layout (model.decoder.* with fused experts and
per_expert_scale; one file or an index with shards) plus a uint16 token
file. A coordinator and four
CPU workers on loopback then train 3 steps with `shardctl train --init-from
--data-order strided --json` at 1, 2 and 4 workers under every strategy
that applies (and HSDP, 2 shards x 2 replicas), and the losses and gradient
norms of the 3 steps are compared with hf_reference_test.py's float64
forward, autograd and
torch.optim.AdamW with the same hyper-parameters. Then the checkpoint
saved after step 3 goes through `shardctl checkpoint export --hf OUT`, and a
job started with `--model OUT --init-from OUT` must see the loss the
reference has after its 3 updates.

Usage: train_reference_test.py BIN_DIR MODEL_DUMP CONFIG.json [...]
  BIN_DIR holds server/shardd-coordinator, worker/shardd-worker and
  client/shardctl (bazel-bin's layout).
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardd_cluster import (BATCH, BETAS, EPS, LR, SEQ, STEPS,  # noqa: E402
                            WEIGHT_DECAY, Cluster, train)
from hf_checkpoint import (DIFFUSION_GEMMA, read_diffusion_gemma,  # noqa: E402
                           save_hf)
from hf_reference_test import forward, gemma_block_diffusion_step  # noqa: E402

torch.set_default_dtype(torch.float64)

# fp32 (--no-mixed-precision) against float64: the 1e-5 relative.
# Rounding errors of the fp32 forward and backward are independent across
# the ~L = 40 chained operations of n <= 128 terms each (see
# hf_reference_test.py), so they grow like sqrt(L n) u = 72 * 2^-24 = 4.3e-6
# rather than the worst case L n u; AdamW's first steps move each weight by
# about lr * sign(g) whatever the rounding, except where |g| is within
# rounding of 0, whose contribution to the loss is second order.
FP32_BOUND = 1e-5
# Mixed precision (bf16 gather and compute, fp32 master and reduce): every
# weight and stored activation is rounded to bf16 (relative error at most
# u = 2^-9) about R = 12 times on a path through one layer (weights of the
# norms, projections, router and experts; the normed input, attention
# output, expert activations), R = 2 * 12 + 3 for the two layers, embedding
# and head. First order, step 1's loss and gradient norm (same weights) move
# by at most R * u = 27 * 2^-9 = 5.3e-2 relative. After that the weights
# differ: AdamW's first updates are about lr * sign(g), so a gradient
# element i whose rounding error e_i exceeds |g_i| may move the other way,
# a weight change of 2 lr where |g_i| <= |e_i|; the loss then moves by at
# most sum_i |g_i| 2 lr <= 2 lr R u |g|_1 per earlier step (first order).
# Later gradient norms also move through the curvature, which has no such
# bound, so in bf16 only step 1's gradient norm is compared.
BF16_BOUND = 27 * 2.0 ** -9
# DiffusionGemmaForBlockDiffusion trains the 3-pass block-diffusion step
# (hf_reference_test.py's gemma_block_diffusion_step: encode, no-grad
# self-conditioning decode, decode), whose chain hf_reference_test.py puts
# at L = 3 x 100 operations of n <= 128 terms: sqrt(L n) u = 196 * 2^-24 =
# 1.2e-5, times the 2.3 that FP32_BOUND allows over its own estimate
# (1e-5 / 4.3e-6): 2.7e-5, for its fp32 losses and gradient norms.
# Its later steps are not compared along the reference's own trajectory:
# an element whose gradient is within the workers' rounding of 0 moves by
# up to 2 lr the other way, and the next step's loss moves by 2 lr times
# that element's next gradient, which nothing bounds; measured, one
# embedding element (step 1's gradient 5.5e-6) so flipped moves step 2's
# loss by 3e-4 relative, and 2 workers' step 2 loss is 0.6% off. So each
# run keeps a checkpoint per step; steps 2 and 3 are compared with the
# reference's loss and gradient norm on shardd's own weights after steps 1
# and 2 (exported with `checkpoint export --hf`), step 1's AdamW update
# element-wise (adamw_update_ratio), and the restarted job with the
# reference on the exported weights. In bf16 those weights are the fp32
# masters, so every step's loss is within BF16_BOUND (no update term);
# the gradient norms are not compared in bf16: the self-conditioning
# signal (the decode's probabilities times the table, near the mean
# embedding) is renormalised, which amplifies rounding — in float64, a
# relative 2^-9 perturbation of those probabilities alone moves step 1's
# gradient norm by 6% (the loss by 0.9%), and shardd's bf16 step 1 norm is
# 22% off.
DG_FP32_BOUND = 2.3 * (300 * 128) ** 0.5 * 2.0 ** -24


def reference(architecture, dims, params, tokens, steps=STEPS, first_step=0,
              first_update=None, response=0, loss_weights=(1.0, 1.0)):
    """(loss, grad_norm, |grad|_1, loss without the router's auxiliary
    term) of each step: float64 forward and
    autograd, then torch.optim.AdamW, on the strided windows the workers
    read; one more entry, without its update, for the weights after
    STEPS updates (on the first step's batch again, as a job started from
    them reads it). `first_update`, when given, receives each trainable
    parameter's (weights after the first update, that step's gradient).
    `response`: DiffusionGemma's canvas rows (0: one canvas_length block);
    `loss_weights`: its (encoder, diffusion) loss weights."""
    # DeepSeek-V3's e_score_correction_bias is a buffer in HF and frozen in
    # shardd, as are DiffusionGemma's router (scale, proj) and layer_scalar:
    # no gradient, no update, not in the gradient norm.
    diffusion = architecture == DIFFUSION_GEMMA
    frozen = (("e_score_correction_bias", "moe.gate.scale",
               "moe.gate.proj.weight", "layer_scalar") if diffusion
              else ("e_score_correction_bias",))
    p = {n: w.clone().requires_grad_(not n.endswith(frozen))
         for n, w in params.items()}
    trainable = [w for w in p.values() if w.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(first_step, first_step + steps + 1):
        # Step s reads sequences [s B, (s + 1) B); sequence k is the window
        # of SEQ + 1 tokens at k * SEQ (worker/data/token_file.h, strided).
        first = (step % STEPS) * BATCH
        rows = [tokens[k * SEQ: k * SEQ + SEQ + 1]
                for k in range(first, first + BATCH)]
        batch = {"architecture": architecture, "dims": dims,
                 "batch": BATCH, "seq": SEQ,
                 "inputs": [t for r in rows for t in r[:-1]],
                 "targets": [t for r in rows for t in r[1:]]}
        if diffusion:
            # The noise and coins are keyed by (optimizer step, global
            # sequence index); the job started from the export runs its
            # step 0 on sequences [0, B) again.
            batch["diffusion"] = {
                "step": step % STEPS,
                "sequence_indices": list(range(first, first + BATCH)),
                "canvas_length": int(dims["canvas_length"]),
                "response_length": response,
                "encoder_loss_weight": loss_weights[0],
                "diffusion_loss_weight": loss_weights[1]}
        for w in trainable:
            w.grad = None
        stats = {}
        loss = (gemma_block_diffusion_step(batch, p)[0] if diffusion
                else forward(batch, p, stats))
        loss.backward()
        norm = torch.sqrt(sum((w.grad ** 2).sum() for w in trainable))
        l1 = sum(w.grad.abs().sum() for w in trainable)
        # What an evaluation scores: the loss without the router's
        # load-balancing term.
        ce = loss.item() - float(dims.get("router_aux_loss_coef", 0.0)) * (
            stats.get("aux", 0.0))
        out.append((loss.item(), norm.item(), l1.item(), ce))
        if step < first_step + steps:
            opt.step()
            if first_update is not None and step == first_step:
                first_update.update(
                    {n: (w.detach().clone(), w.grad.clone())
                     for n, w in p.items() if w.requires_grad})
    return out


def adamw_update_ratio(got, first_update, grad_norm):
    """DiffusionGemma, fp32: shardd's weights after step 1 against the
    reference's, relative to a per-element bound. AdamW's first update is
    lr g / (|g| + eps) (plus the weight decay, the same on both sides); an
    error e in g moves it by at most 2 lr min(1, |e| / |g|), and |e| <=
    DG_FP32_BOUND |g|_2 (the norm-wise bound), so elements whose |g| is
    within that of 0 may flip (2 lr); every other is checked to relative
    |e| / |g|. Plus fp32 rounding of the weight (2^-23 |w|). Returns the
    largest ratio of the difference to that bound, the largest over the
    elements with |g| > |e|, their count, and how many moved by > lr."""
    worst, worst_checked, checked, flipped = 0.0, 0.0, 0, 0
    e = DG_FP32_BOUND * grad_norm
    for name, (want, grad) in first_update.items():
        limit = (2 * LR * torch.clamp(e / grad.abs(), max=1.0)
                 + 2.0 ** -23 * want.abs() + 1e-30)
        ratio = (got[name] - want).abs() / limit
        worst = max(worst, ratio.max().item())
        big = grad.abs() > e
        checked += int(big.sum())
        if big.any():
            worst_checked = max(worst_checked, ratio[big].max().item())
        flipped += int(((got[name] - want).abs() > LR).sum())
    return worst, worst_checked, checked, flipped


# Which HF layout each config is written in: (dtype, files).
STORAGE = {
    "tiny_llama3.json": ("F32", 1),
    "tiny_mixtral.json": ("F32", 3),
    "tiny_qwen3_moe.json": ("BF16", 2),
    "tiny_qwen3_moe_unnormalized.json": ("F16", 1),
    "tiny_gpt_oss.json": ("F32", 1),
    "tiny_diffusion_gemma.json": ("F32", 2),
}


class Tally:
    """Runs, failures and the largest fp32 / bf16 errors over all checks."""

    def __init__(self):
        self.failures, self.checks = 0, 0
        self.worst_fp32, self.worst_bf16 = 0.0, 0.0

    def add(self, ok, worst, mixed=False):
        self.checks += 1
        self.failures += not ok
        if mixed:
            self.worst_bf16 = max(self.worst_bf16, worst)
        else:
            self.worst_fp32 = max(self.worst_fp32, worst)
        return "ok" if ok else "FAIL"


class ConfigCheck:
    """One config: its random weights written as an HF checkpoint, the
    token file, the float64 reference; then every mesh's run, DiffusionGemma's
    multi-block run, and the export round trip."""

    def __init__(self, cluster, work, dump_binary, config, tally):
        self.cluster, self.work, self.config, self.tally = (
            cluster, work, config, tally)
        self.name = os.path.basename(config)
        with open(config) as f:
            self.architecture = json.load(f)["architectures"][0]
        self.diffusion = self.architecture == DIFFUSION_GEMMA
        dump_path = os.path.join(work, self.name + ".dump.json")
        extra = (["--gate_up_scale=6"]
                 if self.architecture == "GptOssForCausalLM" else [])
        subprocess.run([dump_binary, f"--model={config}", "--batch=1",
                        "--seq=2", "--seed=11", f"--out={dump_path}"] + extra,
                       check=True, timeout=120)
        with open(dump_path) as f:
            dump = json.load(f)
        self.dims = dump["dims"]
        params = {n: torch.tensor(t["values"]).view(t["shape"])
                  for n, t in dump["params"].items()}
        self.dtype, self.files = STORAGE.get(self.name, ("F32", 1))
        self.hf_dir = os.path.join(work, self.name + ".hf")
        self.params, self.total_bytes = save_hf(
            self.hf_dir, params, self.architecture, self.dtype, self.files)
        vocab = int(self.dims["vocab_size"])
        gen = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, vocab, (STEPS * BATCH * SEQ + 1,),
                                    generator=gen).tolist()
        self.data = os.path.join(work, self.name + ".bin")
        with open(self.data, "wb") as f:
            f.write(struct.pack(f"<{len(self.tokens)}H", *self.tokens))
        self.first_update = {}
        self.want = reference(self.architecture, self.dims, self.params,
                              self.tokens, first_update=self.first_update)
        print(f"{self.name} ({self.architecture}, {self.dtype} in "
              f"{self.files} file(s)): reference losses "
              + ", ".join(f"{w[0]:.9f}" for w in self.want))

    def runs(self):
        """(dp, replicas, strategy, mixed precision): every strategy at 1, 2
        and 4 ranks, HSDP 2 x 2, and bf16 at 2 ranks."""
        moe = any(".moe.experts." in n for n in self.params)
        strategies = ["default", "megatron_fsdp"] + (
            ["diffusion_gemma"] if moe else [])
        runs = [(w, 1, s, False) for w in (1, 2, 4) for s in strategies]
        return runs + [(2, 2, "default", False), (2, 1, "default", True)]

    def diffusion_reference(self, saved, run_name, mixed):
        """DiffusionGemma's reference for one run: step 1 along the
        reference's trajectory, steps 2 and 3 from shardd's own weights after
        steps 1 and 2 (exported; see DG_FP32_BOUND); and, in fp32, step 1's
        AdamW update (adamw_update_ratio's tuple, else None)."""
        run_want, update = [self.want[0]], None
        # The last entry: the weights after the last step on the first
        # batch, which the evaluation scores.
        for s in range(1, STEPS + 1):
            exp = os.path.join(self.work, f"{run_name}.{s}")
            self.cluster.shardctl_local([
                "checkpoint", "export", "--checkpoint",
                os.path.join(self.cluster.checkpoints, saved[s - 1]),
                "--hf", exp])
            weights = read_diffusion_gemma(exp, self.params)
            run_want += reference(self.architecture, self.dims, weights,
                                  self.tokens, steps=0, first_step=s)
            if s == 1 and not mixed:
                update = adamw_update_ratio(weights, self.first_update,
                                            self.want[0][1])
        return run_want, update

    def check_run(self, world, replicas, strategy, mixed):
        diffusion = self.diffusion
        sizes = self.cluster.worker_log_sizes()
        mesh = f"{world}" if replicas == 1 else f"{world}x{replicas}"
        # The evaluation after the last step reads the token file's first
        # global batch in order: the first step's batch, scored with the
        # weights after the last update (the reference's extra entry).
        got, saved, eval_loss = train(
            self.cluster, self.config, self.hf_dir, self.data, world, strategy,
            mixed, extra=["--replicate", str(replicas),
                          "--eval-data", self.data, "--eval-batches", "1"]
            + (["--checkpoint-every", "1"] if diffusion else []))
        if diffusion:
            bound = BF16_BOUND if mixed else DG_FP32_BOUND
            run_want, update = self.diffusion_reference(
                saved, f"{self.name}.{mesh}.{strategy}.{mixed}", mixed)
        else:
            bound = BF16_BOUND if mixed else FP32_BOUND
            run_want, update = self.want, None
        # Errors relative to each check's own bound.
        errs, ratios, flips = [], [], 0.0
        for step, ((gl, gn), (wl, wn, l1, _)) in enumerate(zip(got, run_want)):
            loss_bound = bound + (flips / abs(wl)
                                  if mixed and not diffusion else 0)
            errs.append(abs(gl - wl) / abs(wl))
            ratios.append(errs[-1] / loss_bound)
            if not mixed or (step == 0 and not diffusion):
                errs.append(abs(gn - wn) / abs(wn))
                ratios.append(errs[-1] / bound)
            flips += 2 * LR * BF16_BOUND * l1
        # The held-out loss: the same bound as a step's loss, with the
        # flips of every update.
        want_eval = run_want[STEPS][3]
        eval_bound = bound + (flips / abs(want_eval)
                              if mixed and not diffusion else 0)
        errs.append(abs(eval_loss - want_eval) / abs(want_eval))
        ratios.append(errs[-1] / eval_bound)
        worst, ratio = max(errs), max(ratios)
        if update is not None:
            # Flips reach 2 lr by construction (update_ratio just under 1):
            # the status shows the checked ones.
            update_ratio, checked_ratio, checked, flipped = update
            ratio = max(ratio, checked_ratio,
                        update_ratio if update_ratio > 1 else 0)
        read = self.cluster.bytes_read_since(sizes)
        # Every element is owned by one rank of a replica: each replica reads
        # the checkpoint's bytes exactly once (GPT-OSS's interleaved rows may
        # be read whole at a range's ends).
        exact = self.architecture != "GptOssForCausalLM"
        want_read = self.total_bytes * replicas
        read_ok = read == want_read if exact else read >= want_read
        status = self.tally.add(ratio <= 1 and read_ok, worst, mixed)
        if update is not None:
            print(f"    step 1's AdamW update: {update_ratio:.4f} of its "
                  f"bound; {flipped} element(s) moved the other way; the "
                  f"{checked} with |g| above the gradient's error bound "
                  f"{checked_ratio:.2e} of theirs")
        update_term = " + the update term" if mixed and not diffusion else ""
        print(f"  {status} {mesh} worker(s) {strategy:14s} "
              f"{'bf16' if mixed else 'fp32'}: largest relative error "
              f"{worst:.2e}, {ratio:.2f} of its bound ({bound:.1e}"
              f"{update_term}); held-out loss {eval_loss:.9f} "
              f"({abs(eval_loss - want_eval) / abs(want_eval):.2e}); {read} "
              f"bytes read ({replicas} x {self.total_bytes} wanted)")
        if status == "FAIL":
            print("    shardd", got, "eval", eval_loss,
                  "\n    reference", run_want)

    def check_multi_block(self):
        """DiffusionGemma's training knobs through the daemons: a response of
        12 tokens in canvas_length-8 blocks (8, 4) after a 4-token prompt
        (--response-length), then loss weights 0.5 (encoder) and 2
        (diffusion): step 1 against the reference."""
        for label, flags, kwargs in (
                ("response 12 (blocks 8 + 4)", ["--response-length", "12"],
                 {"response": 12}),
                ("loss weights 0.5 and 2",
                 ["--encoder-loss-weight", "0.5", "--diffusion-loss-weight",
                  "2"], {"loss_weights": (0.5, 2.0)})):
            got, _, _ = train(self.cluster, self.config, self.hf_dir,
                              self.data, 2, "default", False, steps=1,
                              extra=flags)
            want = reference(self.architecture, self.dims, self.params,
                             self.tokens, steps=0, **kwargs)[0]
            errs = [abs(got[0][0] - want[0]) / abs(want[0]),
                    abs(got[0][1] - want[1]) / abs(want[1])]
            status = self.tally.add(max(errs) <= DG_FP32_BOUND, max(errs))
            print(f"  {status} 2 worker(s) default        fp32, {label}: "
                  f"loss and gradient norm within {max(errs):.2e} (bound "
                  f"{DG_FP32_BOUND:.1e})")

    def check_export_round_trip(self):
        """Export the state after 3 steps and start a job from it."""
        _, saved, _ = train(self.cluster, self.config, self.hf_dir, self.data, 2,
                         "default", False,
                         extra=["--checkpoint-every", str(STEPS)])
        out = os.path.join(self.work, self.name + ".export")
        self.cluster.shardctl_local([
            "checkpoint", "export", "--checkpoint",
            os.path.join(self.cluster.checkpoints, saved[-1]), "--hf", out])
        resumed, _, _ = train(self.cluster, out, out, self.data, 1, "default",
                           False, steps=1)
        after = self.want[STEPS][0]
        if self.diffusion:
            # The reference on the exported weights (see DG_FP32_BOUND), at
            # the new job's step 0.
            after = reference(self.architecture, self.dims,
                              read_diffusion_gemma(out, self.params),
                              self.tokens, steps=0, first_step=STEPS)[0][0]
        err = abs(resumed[0][0] - after) / abs(after)
        bound = DG_FP32_BOUND if self.diffusion else FP32_BOUND
        status = self.tally.add(err <= bound, err)
        print(f"  {status} checkpoint export --hf, then --init-from it: "
              f"loss {resumed[0][0]:.9f} vs the reference's "
              + ("on the exported weights" if self.diffusion
                 else f"after {STEPS} updates")
              + f" {after:.9f} (relative {err:.2e})")


def main():
    bin_dir, dump_binary, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
    tally = Tally()
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(bin_dir, work)
        try:
            for config in configs:
                check = ConfigCheck(cluster, work, dump_binary, config, tally)
                for run in check.runs():
                    check.check_run(*run)
                if check.diffusion:
                    check.check_multi_block()
                check.check_export_round_trip()
        finally:
            cluster.stop()
    print(f"{tally.checks} runs: largest fp32 error {tally.worst_fp32:.2e}, "
          f"bf16 {tally.worst_bf16:.2e}; {tally.failures} failed")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
