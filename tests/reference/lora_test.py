"""LoRA fine-tuning end to end (docs/lora.md), against PEFT:

- `shardctl train --lora-rank 4 --lora-alpha 8 --lora-targets
  q_proj,k_proj,v_proj,o_proj,experts` on the tiny_chat SFT dataset
  starts from the base model exactly (B = 0: step 1's loss is the base
  model's), trains only the adapters, and `shardctl checkpoint export`
  writes PEFT's adapter_model.safetensors and adapter_config.json, which
  PeftModel.from_pretrained loads onto transformers' Qwen3-MoE with no key
  missing or left over;
- a job that resumes from base + those adapters (--init-from BASE
  --lora-from ADAPTERS) over 1 and 2 CPU workers, and 2 with expert
  parallelism (each holding half the experts and their adapters), equals
  PEFT's own model
  trained with torch.optim.AdamW on the same packed rows (float64 eager,
  only the adapters trainable): every step's loss and gradient norm within
  the fp32 bound of transformers_test.py; the same adapters read with a
  wrong scale (alpha doubled) must fail that bound;
- bad input is refused naming the flag or field: a target that matches
  nothing, a rank of 0, adapters of another rank;
- the plan counts optimizer state and gradient reduce-scatters for the
  adapters only;
- the response-token loss falls under LoRA training.

Usage: lora_test.py BIN_DIR REPO_ROOT
"""

import json
import os
import shutil
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardd_cluster import BETAS, EPS, LR, WEIGHT_DECAY, Cluster  # noqa: E402
from sft_test import (BATCH, SEQ, SEED, STEPS, Checks,  # noqa: E402
                      oracle_steps, prepare_tiny_chat, read_dataset)
from transformers_test import (FP32_BOUND, load_config, load_oracle,  # noqa
                               redraw)

RANK, ALPHA = 4, 8
TARGETS = "q_proj,k_proj,v_proj,o_proj,experts"
LORA = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
        "--lora-targets", TARGETS]


def steps_of(run):
    return [json.loads(line) for line in run.stdout.splitlines()
            if line.startswith('{"event":"step"')]


def peft_model(base_dir, adapters):
    """transformers' model of base_dir (float64, eager) with the adapters
    loaded by PEFT, trainable; and the keys PEFT did not match."""
    import peft
    model = load_oracle(base_dir)[0]
    model = peft.PeftModel.from_pretrained(model, adapters, is_trainable=True)
    # from_pretrained warns of unmatched keys; load again to see them.
    result = peft.set_peft_model_state_dict(
        model, peft.utils.load_peft_weights(adapters))
    return model, result


def fresh_then_export(cluster, check, work, base, common, lora, examples,
                      pad, trainable, label):
    """Job 1: fresh adapters (B = 0) start from the base model; its
    checkpoint exported in PEFT's format and loaded by PEFT. Returns the
    adapters' directory, their config and PEFT's model with them."""
    base_steps = oracle_steps(load_oracle(base)[0], examples, pad, True)
    r = cluster.shardctl(["train"] + common + lora + [
        "--steps", str(STEPS), "--dp", "2", "--checkpoint-every",
        str(STEPS)])
    got = steps_of(r)
    err = abs(got[0]["loss"] - base_steps[0][0]) / base_steps[0][0]
    check(len(got) == STEPS and err <= FP32_BOUND,
          f"{label}: step 1 with fresh adapters is the base model's loss "
          f"({got[0]['loss']:.6f} vs {base_steps[0][0]:.6f}, {err:.1e})")
    saved = [s["checkpoint"] for s in got if "checkpoint" in s]
    adapters = os.path.join(work, f"adapters_{label}")
    cluster.shardctl_local([
        "checkpoint", "export", "--checkpoint",
        os.path.join(cluster.checkpoints, saved[-1]), "--hf", adapters])
    files = sorted(os.listdir(adapters))
    config = json.load(open(os.path.join(adapters, "adapter_config.json")))
    check(files == ["adapter_config.json", "adapter_model.safetensors"] and
          config["r"] == RANK and config["lora_alpha"] == ALPHA and
          config["peft_type"] == "LORA",
          f"{label}: checkpoint export writes PEFT's files {files}, r "
          f"{config.get('r')}, lora_alpha {config.get('lora_alpha')}")
    oracle, result = peft_model(base, adapters)
    missing = [k for k in result.missing_keys if "lora_" in k]
    unexpected = list(result.unexpected_keys)
    trained = sum(p.numel() for p in oracle.parameters() if p.requires_grad)
    check(not missing and not unexpected and trained == trainable,
          f"{label}: PeftModel.from_pretrained loads them: {trained} adapter "
          f"parameters (the plan: {trainable}), missing {missing[:3]}, "
          f"unexpected {unexpected[:3]}")
    b_norm = sum(float(p.detach().abs().sum())
                 for n, p in oracle.named_parameters() if "lora_B" in n)
    check(b_norm > 0, f"{label}: the adapters trained (|B| = {b_norm:.3e})")
    return adapters, config, oracle


def resumed(cluster, common, lora, adapters, world, ep=1):
    """(loss, grad_norm) per step of a job from base + adapters."""
    r = cluster.shardctl(["train"] + common + lora + [
        "--lora-from", adapters, "--steps", str(STEPS), "--dp", str(world)] +
        (["--ep", str(ep)] if ep > 1 else []))
    return [(s["loss"], s["grad_norm"]) for s in steps_of(r)]


def relative_errors(got, want):
    return [max(abs(gl - wl) / wl, abs(gn - wn) / wn)
            for (gl, gn), (wl, wn) in zip(got, want)]


def save_base(repo, config, directory):
    model = transformers.AutoModelForCausalLM.from_config(
        load_config(os.path.join(repo, "tests/data", config)),
        attn_implementation="eager", dtype=torch.float32)
    redraw(model, torch.Generator().manual_seed(3))
    model.save_pretrained(directory)


def train_args(base, dataset):
    return ["--model", base, "--init-from", base, "--data", dataset,
            "--seed", str(SEED), "--global-batch", str(BATCH), "--seq",
            str(SEQ), "--lr", str(LR), "--beta1", str(BETAS[0]),
            "--beta2", str(BETAS[1]), "--eps", str(EPS),
            "--weight-decay", str(WEIGHT_DECAY), "--grad-clip", "0",
            "--no-mixed-precision", "--json"]


def main():
    bin_dir, repo = sys.argv[1], sys.argv[2]
    check = Checks()

    with tempfile.TemporaryDirectory() as work:
        dataset, run = prepare_tiny_chat(repo, work)
        if run.returncode != 0:
            print(run.stderr)
            return 1
        examples = read_dataset(dataset)
        pad = json.load(open(os.path.join(dataset,
                                          "shardd_sft.json")))["pad_id"]
        base = os.path.join(work, "base")
        save_base(repo, "tiny_qwen3_moe.json", base)
        common = train_args(base, dataset)
        cluster = Cluster(bin_dir, work)
        try:
            # The plan: optimizer state and reduce-scatters for the
            # adapters only.
            plans = {}
            for name, extra in (("full", []), ("lora", LORA)):
                r = cluster.shardctl(["plan", "--model", base, "--dp", "2",
                                      "--no-mixed-precision", "--json"] +
                                     extra)
                plans[name] = json.loads(r.stdout)
            print("plan summaries:", plans["full"].get("summary"),
                  plans["lora"].get("summary"))
            full_sum, lora_sum = (plans[k]["summary"] for k in ("full",
                                                                  "lora"))
            # Per layer: q, o [64, 64] and k, v [32, 64] each R (in + out);
            # experts 8 R (64 + 64) for gate_up (one A for both halves) and
            # 8 R (32 + 64) for down.
            n_adapters = 2 * (RANK * (2 * 128 + 2 * 96) +
                              8 * RANK * (128 + 96))
            check(int(lora_sum["trainable_params"]) == n_adapters and
                  int(lora_sum["total_params"]) ==
                  int(full_sum["total_params"]) + n_adapters,
                  f"trainable parameters {full_sum['trainable_params']} -> "
                  f"{lora_sum['trainable_params']} (the adapters alone)")
            # AdamW's two fp32 moments and the fp32 gradient, per rank.
            ratio = (int(lora_sum["trainable_params"]) /
                     int(full_sum["trainable_params"]))
            for section, key in (("per_rank", "optimizer_bytes"),
                                 ("per_rank", "grad_bytes"),
                                 ("comm", "reduce_scatter_bytes")):
                f, l = (int(plans[k][section][key]) for k in ("full", "lora"))
                check(0 < l <= 1.1 * ratio * f,
                      f"plan {key}: {f} -> {l} (the adapters' share "
                      f"{ratio:.3f}, padding aside)")

            adapters, config, oracle = fresh_then_export(
                cluster, check, work, base, common, LORA, examples, pad,
                int(lora_sum["trainable_params"]), "Qwen3-MoE")

            # Job 2: base + adapters against PEFT's own training.
            want = oracle_steps(oracle, examples, pad, True)
            wrong_dir = os.path.join(work, "adapters_wrong_scale")
            shutil.copytree(adapters, wrong_dir)
            wrong_config = dict(config, lora_alpha=2 * ALPHA)
            with open(os.path.join(wrong_dir, "adapter_config.json"),
                      "w") as f:
                json.dump(wrong_config, f)
            wrong = oracle_steps(peft_model(base, wrong_dir)[0], examples,
                                 pad, True)
            print("peft:", want)
            for world, ep in ((1, 1), (2, 1), (2, 2)):
                got = resumed(cluster, common, LORA, adapters, world, ep)
                errs = relative_errors(got, want)
                check(len(got) == STEPS and max(errs) <= FP32_BOUND,
                      f"base + adapters, {world} worker(s), ep {ep}: losses and "
                      f"gradient norms within {max(errs):.2e} of PEFT's "
                      f"(bound {FP32_BOUND:.0e}): {got}")
                (gl, gn), (wl, wn) = got[0], wrong[0]
                away = max(abs(gl - wl) / wl, abs(gn - wn) / wn)
                check(away > FP32_BOUND,
                      f"{world} worker(s): the adapters at twice their scale "
                      f"are {away:.2e} away at step 1 (outside the bound)")

            # DeepSeek-V3: latent attention's projections, the dense MLP of
            # layer 0 and the shared experts (gate_proj, up_proj, down_proj,
            # which PEFT takes as target parameters, checkpoint/
            # peft_adapters.h) and the routed experts.
            ds_base = os.path.join(work, "deepseek_base")
            save_base(repo, "tiny_deepseek_v3.json", ds_base)
            ds_common = train_args(ds_base, dataset)
            ds_lora = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                       "--lora-targets",
                       "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,"
                       "gate_proj,up_proj,down_proj,experts"]
            r = cluster.shardctl(["plan", "--model", ds_base, "--dp", "2",
                                  "--no-mixed-precision", "--json"] + ds_lora)
            ds_trainable = int(json.loads(r.stdout)["summary"][
                "trainable_params"])
            ds_adapters, _, ds_oracle = fresh_then_export(
                cluster, check, work, ds_base, ds_common, ds_lora, examples,
                pad, ds_trainable, "DeepSeek-V3")
            ds_want = oracle_steps(ds_oracle, examples, pad, True)
            got = resumed(cluster, ds_common, ds_lora, ds_adapters, 2)
            errs = relative_errors(got, ds_want)
            check(len(got) == STEPS and max(errs) <= FP32_BOUND,
                  f"DeepSeek-V3 base + adapters, 2 workers: losses and "
                  f"gradient norms within {max(errs):.2e} of PEFT's (bound "
                  f"{FP32_BOUND:.0e}): {got}")

            # Bad input, named.
            cases = [
                (["--lora-rank", "4", "--lora-targets", "qproj"],
                 "lora.targets: 'qproj' matches no linear module"),
                (["--lora-rank", "0", "--lora-targets", "q_proj"],
                 "--lora-rank: expected an integer >= 1, got '0'"),
                (["--lora-rank", "8", "--lora-targets", TARGETS,
                  "--lora-from", adapters],
                 "r is 4"),
                (["--lora-targets", "q_proj"],
                 "--lora-targets needs --lora-rank"),
            ]
            for extra, message in cases:
                r = cluster.shardctl(["train"] + common + extra +
                                     ["--steps", "1", "--dp", "1"],
                                     check=False)
                text = r.stdout + r.stderr
                check(r.returncode != 0 and message in text,
                      f"{' '.join(extra)} is refused: "
                      f"{text.strip().splitlines()[-1] if text.strip() else ''}")

            # Longer training: the response-token loss falls.
            r = cluster.shardctl(
                ["train", "--model", base, "--init-from", base, "--data",
                 dataset, "--steps", "20", "--global-batch", str(BATCH),
                 "--seq", str(SEQ), "--lr", "0.01", "--dp", "2", "--json"] +
                LORA)
            curve = [s["loss"] for s in steps_of(r)]
            check(len(curve) == 20 and curve[-1] < 0.7 * curve[0],
                  f"20 LoRA steps at lr 0.01: loss {curve[0]:.3f} -> "
                  f"{curve[-1]:.3f}")
        finally:
            cluster.stop()
    print(f"{check.failures} failed")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
