"""DiffusionGemma's block-diffusion training through the daemons against
Hugging Face transformers' own DiffusionGemmaForBlockDiffusion.

transformers builds the tiny model from tests/data/tiny_diffusion_gemma.json
(with a tiny vision tower, which its encoder needs and shardd skips), its
weights redrawn as in transformers_test.py (per_expert_scale 1: shardd folds
it into the down weights), and `save_pretrained` writes the released layout
(`model.decoder.*`, fused experts, the encoder's layer_scalar copies, the
vision tower) in 2 shards. A coordinator and four CPU workers on loopback
train 3 steps with `shardctl train --model DIR --init-from DIR` at 1, 2 and
4 workers under every strategy, HSDP 2 x 2 and bf16; the oracle is
diffusion_gemma_oracle.block_diffusion_loss on the transformers model in
float64 with torch.optim.AdamW (the router frozen, as in shardd).

Step 1 is compared along the oracle's trajectory. Steps 2 and 3 are not:
an element whose gradient is within the workers' rounding of 0 takes its
first AdamW update (lr) either way, and the next loss moves by 2 lr times
that element's next gradient, which nothing bounds (measured: one
embedding element moved step 2's loss by 3e-4, and 2 workers' step 2 was
0.6% off). So each run keeps a checkpoint per step; steps 2 and 3 are
compared with the oracle on shardd's own exported weights after steps 1
and 2 (`checkpoint export --hf`, read back with from_pretrained), step 1's
AdamW update element-wise (adamw_update_ratio), the held-out evaluation and
a job restarted from the export with the oracle on the exported weights.

Each comparison can fail: step 1 is repeated against the oracle without
its soft-cap, with a canvas that sees the clean response, and with the
self-conditioning signal dropped; each must miss shardd's step 1. The
config's pad_token_id (0) is in the batches: transformers' embedding passes
no gradient to its row from lookups, and neither may shardd's.

Usage: diffusion_gemma_test.py BIN_DIR CONFIG.json
"""

import os
import struct
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diffusion_gemma_oracle as dg  # noqa: E402
from shardd_cluster import (BATCH, BETAS, EPS, LR, SEQ, STEPS,  # noqa: E402
                            WEIGHT_DECAY, Cluster, train)
from transformers_test import (BF16_BOUND, Tally,  # noqa: E402
                               gradient_norms, no_padding_idx, patched,
                               redraw, tensor_bytes)

# The 3-pass step's chain: L = 3 x 100 operations of n <= 128 terms,
# sqrt(L n) u = 196 * 2^-24 = 1.2e-5, times the 2.3 that FP32_BOUND allows
# over its own estimate (1e-5 / 4.3e-6): 2.7e-5 (docs/testing.md).
DG_FP32_BOUND = 2.3 * (300 * 128) ** 0.5 * 2.0 ** -24


def batch_of(tokens, step):
    """Step s's rows [BATCH, SEQ + 1] (strided windows, as the workers read)
    and their global sequence indices."""
    first = (step % STEPS) * BATCH
    rows = torch.tensor([tokens[k * SEQ: k * SEQ + SEQ + 1]
                         for k in range(first, first + BATCH)])
    return rows, list(range(first, first + BATCH))


def oracle(model, tokens, steps=STEPS, first_step=0, first_update=None,
           response=0, loss_weights=(1.0, 1.0)):
    """(loss, gradient norm, |gradient|_1) of each step of torch.optim.AdamW
    on `model` (float64, changed in place), plus one more entry without its
    update: the weights after the last update on the first step's batch,
    which the evaluation scores. `first_update`, when given, receives each
    trainable parameter's (weights after the first update, its gradient)."""
    trainable = dg.freeze(model)
    opt = torch.optim.AdamW(list(trainable.values()), lr=LR, betas=BETAS,
                            eps=EPS, weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(first_step, first_step + steps + 1):
        rows, indices = batch_of(tokens, step)
        opt.zero_grad(set_to_none=True)
        loss, _, _ = dg.block_diffusion_loss(
            model, rows[:, :-1], step % STEPS, indices, response, loss_weights)
        loss.backward()
        norm, l1 = gradient_norms(trainable.values())
        out.append((loss.item(), norm, l1))
        if step < first_step + steps:
            opt.step()
            if first_update is not None and step == first_step:
                first_update.update({n: (w.detach().clone(), w.grad.clone())
                                     for n, w in trainable.items()})
    return out


def adamw_update_ratio(got, first_update, grad_norm):
    """shardd's weights after step 1 against the oracle's, relative to a
    per-element bound. AdamW's first update is lr g / (|g| + eps) (plus the
    weight decay, the same on both sides); an error e in g moves it by at
    most 2 lr min(1, |e| / |g|), and |e| <= DG_FP32_BOUND |g|_2 (the
    norm-wise bound), so elements whose |g| is within that of 0 may flip
    (2 lr); every other is checked to relative |e| / |g|. Plus fp32 rounding
    of the weight (2^-23 |w|). Returns the largest ratio of the difference
    to that bound, the largest over the elements with |g| > |e|, their count,
    and how many moved by > lr."""
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


# Deliberate errors: each must move step 1 outside the bound.
def no_softcap(model):
    return patched([(model, "final_logit_softcapping", 1e9)])


def canvas_sees_the_answer(model):
    """The canvas attends to every encoder key, the clean response too."""
    original = dg.training_masks

    def open_masks(text, s, r, block_len, dtype):
        masks = original(text, s, r, block_len, dtype)
        for mask in masks.values():
            mask[..., :s] = 0.0
        return masks
    return patched([(dg, "training_masks", open_masks)])


def no_self_conditioning(model):
    original = dg.diffusion_canvas

    def no_coins(*args):
        noised, coins = original(*args)
        return noised, [False] * len(coins)
    return patched([(dg, "diffusion_canvas", no_coins)])


MUTATIONS = (("without its soft-cap", no_softcap),
             ("without padding_idx", no_padding_idx),
             ("with a canvas that sees the clean response",
              canvas_sees_the_answer),
             ("without self-conditioning", no_self_conditioning))


class Check:
    def __init__(self, cluster, work, config, tally):
        self.cluster, self.work, self.tally = cluster, work, tally
        self.name = os.path.basename(config)
        self.hf_dir = os.path.join(work, "hf")
        gen = torch.Generator().manual_seed(5)
        model = transformers.DiffusionGemmaForBlockDiffusion._from_config(
            dg.config_with_vision(config), attn_implementation="eager",
            dtype=torch.float32)
        redraw(model, gen)
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n.endswith("per_expert_scale"):
                    w.fill_(1.0)
        model.save_pretrained(self.hf_dir, max_shard_size="200KB")
        # shardd reads the text stack (model.decoder.*), not the vision tower
        # or the encoder's copies of layer_scalar.
        self.text_bytes = tensor_bytes(
            self.hf_dir, lambda name: name.startswith("model.decoder."))
        vocab = model.config.text_config.vocab_size
        self.tokens = torch.randint(0, vocab, (STEPS * BATCH * SEQ + 1,),
                                    generator=gen).tolist()
        # The padding token in every step's batch: in the prompt and in the
        # response (the canvas keeps some clean tokens).
        pad = model.config.text_config.pad_token_id
        for step in range(STEPS):
            for k in (2, SEQ + 9, 2 * SEQ + 12, 3 * SEQ + 13):
                self.tokens[step * BATCH * SEQ + k] = pad
        self.data = os.path.join(work, "tokens.bin")
        with open(self.data, "wb") as f:
            f.write(struct.pack(f"<{len(self.tokens)}H", *self.tokens))
        self.first_update = {}
        self.want = oracle(self.load(self.hf_dir), self.tokens,
                           first_update=self.first_update)
        files = len([f for f in os.listdir(self.hf_dir)
                     if f.endswith(".safetensors")])
        print(f"{self.name} (DiffusionGemmaForBlockDiffusion, F32 in {files} "
              "file(s)): transformers' losses "
              + ", ".join(f"{w[0]:.9f}" for w in self.want))

    def load(self, directory):
        model, info = dg.load(directory)
        # shardd's export carries the text stack it trained; the vision
        # tower, which it neither reads nor trains, is not written back.
        info["missing_keys"] = {k for k in info["missing_keys"]
                                if dg.is_text(k)}
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise RuntimeError(f"{directory} does not load into transformers: "
                               f"{problems}")
        return model

    def export(self, checkpoint, label):
        out = os.path.join(self.work, label)
        self.cluster.shardctl_local([
            "checkpoint", "export", "--checkpoint",
            os.path.join(self.cluster.checkpoints, checkpoint), "--hf", out])
        return out

    def run_reference(self, saved, label, mixed):
        """Step 1 along the oracle's trajectory, steps 2 and 3 (and the
        evaluation's entry) on shardd's own weights after steps 1 and 2 (and
        3); in fp32, step 1's AdamW update (adamw_update_ratio's tuple)."""
        want, update = [self.want[0]], None
        for s in range(1, STEPS + 1):
            model = self.load(self.export(saved[s - 1], f"{label}.{s}"))
            if s == 1 and not mixed:
                got = dict(model.named_parameters())
                update = adamw_update_ratio(got, self.first_update,
                                            self.want[0][1])
            want += oracle(model, self.tokens, steps=0, first_step=s)
        return want, update

    def check_run(self, world, replicas, strategy, mixed):
        sizes = self.cluster.worker_log_sizes()
        mesh = f"{world}" if replicas == 1 else f"{world}x{replicas}"
        got, saved, eval_loss = train(
            self.cluster, self.hf_dir, self.hf_dir, self.data, world,
            strategy, mixed,
            extra=["--replicate", str(replicas), "--eval-data", self.data,
                   "--eval-batches", "1", "--checkpoint-every", "1"])
        bound = BF16_BOUND if mixed else DG_FP32_BOUND
        want, update = self.run_reference(
            saved, f"{mesh}.{strategy}.{'bf16' if mixed else 'fp32'}", mixed)
        errs = []
        for (gl, gn), (wl, wn, _) in zip(got, want):
            errs.append(abs(gl - wl) / abs(wl))
            if not mixed:
                # bf16: the renormalised self-conditioning signal amplifies
                # rounding; no gradient norm is compared (docs/testing.md).
                errs.append(abs(gn - wn) / abs(wn))
        errs.append(abs(eval_loss - want[STEPS][0]) / abs(want[STEPS][0]))
        ratio = max(errs) / bound
        if update is not None:
            update_ratio, checked_ratio, checked, flipped = update
            ratio = max(ratio, checked_ratio,
                        update_ratio if update_ratio > 1 else 0)
        read = self.cluster.bytes_read_since(sizes)
        read_ok = read == self.text_bytes * replicas
        status = self.tally.add(ratio <= 1 and read_ok, max(errs),
                                "bf16" if mixed else "fp32")
        if update is not None:
            print(f"    step 1's AdamW update: {update_ratio:.4f} of its "
                  f"bound; {flipped} element(s) moved the other way; the "
                  f"{checked} with |g| above the gradient's error bound "
                  f"{checked_ratio:.2e} of theirs")
        print(f"  {status} {mesh} worker(s) {strategy:14s} "
              f"{'bf16' if mixed else 'fp32'}: largest relative error "
              f"{max(errs):.2e}, {ratio:.2f} of its bound ({bound:.1e}); "
              f"held-out loss {eval_loss:.9f}; {read} bytes read "
              f"({replicas} x {self.text_bytes} wanted)")
        if status == "FAIL":
            print("    shardd", got, "eval", eval_loss, "\n    oracle", want)
        if world == 1 and strategy == "default" and not mixed:
            self.step1 = got[0]

    def check_knobs(self):
        """A 12-token response in blocks of 8 and 4 after a 4-token prompt
        (--response-length), and loss weights 0.5 (encoder) and 2
        (diffusion): step 1 against the oracle with the same settings."""
        for label, flags, kwargs in (
                ("response 12 (blocks 8 + 4)", ["--response-length", "12"],
                 {"response": 12}),
                ("loss weights 0.5 and 2",
                 ["--encoder-loss-weight", "0.5", "--diffusion-loss-weight",
                  "2"], {"loss_weights": (0.5, 2.0)})):
            got, _, _ = train(self.cluster, self.hf_dir, self.hf_dir,
                              self.data, 2, "default", False, steps=1,
                              extra=flags)
            want = oracle(self.load(self.hf_dir), self.tokens, steps=0,
                          **kwargs)[0]
            err = max(abs(got[0][0] - want[0]) / abs(want[0]),
                      abs(got[0][1] - want[1]) / abs(want[1]))
            status = self.tally.add(err <= DG_FP32_BOUND, err)
            print(f"  {status} 2 worker(s) default        fp32, {label}: "
                  f"loss and gradient norm within {err:.2e} (bound "
                  f"{DG_FP32_BOUND:.1e})")

    def check_mutations(self):
        gl, gn = self.step1
        for label, mutation in MUTATIONS:
            model = self.load(self.hf_dir)
            with mutation(model):
                wl, wn, _ = oracle(model, self.tokens, steps=0)[0]
            err = max(abs(gl - wl) / abs(wl), abs(gn - wn) / abs(wn))
            status = self.tally.add(err > DG_FP32_BOUND)
            print(f"  {status} transformers {label} misses shardd's step 1 "
                  f"by {err:.2e} (bound {DG_FP32_BOUND:.1e})")

    def check_export_round_trip(self):
        """The export after 3 steps loads with from_pretrained and a job
        started from it sees the oracle's loss on the exported weights."""
        _, saved, _ = train(self.cluster, self.hf_dir, self.hf_dir, self.data,
                            2, "default", False,
                            extra=["--checkpoint-every", str(STEPS)])
        out = self.export(saved[-1], "round_trip")
        resumed, _, _ = train(self.cluster, out, out, self.data, 1, "default",
                              False, steps=1)
        after = oracle(self.load(out), self.tokens, steps=0,
                       first_step=STEPS)[0][0]
        err = abs(resumed[0][0] - after) / abs(after)
        status = self.tally.add(err <= DG_FP32_BOUND, err)
        print(f"  {status} checkpoint export --hf (from_pretrained: no missing "
              f"text key, no unexpected key), then --init-from it: loss "
              f"{resumed[0][0]:.9f} vs transformers' on the exported weights "
              f"{after:.9f} (relative {err:.2e})")


def main():
    bin_dir, config = sys.argv[1], sys.argv[2]
    tally = Tally()
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(bin_dir, work)
        try:
            check = Check(cluster, work, config, tally)
            runs = [(w, 1, s, False) for w in (1, 2, 4)
                    for s in ("default", "megatron_fsdp", "diffusion_gemma")]
            for run in runs + [(2, 2, "default", False),
                               (2, 1, "default", True)]:
                check.check_run(*run)
            check.check_knobs()
            check.check_mutations()
            check.check_export_round_trip()
        finally:
            cluster.stop()
    return tally.summary()


if __name__ == "__main__":
    sys.exit(main())
