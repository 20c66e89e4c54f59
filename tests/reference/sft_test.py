"""SFT data end to end (docs/sft_data.md), against Hugging Face:

- tools/prepare_sft.py turns tests/data/tiny_chat/chat.jsonl into a dataset
  with the tokenizer's own chat template; the tokens its loss mask keeps,
  decoded, are exactly each conversation's assistant turns with the
  template's end of turn;
- bad input is refused naming the line (not JSON, a role the template does
  not know, no assistant turn) or the flag (an existing --output), and
  nothing is left behind;
- `shardctl train --data DATASET` over 1 and 2 CPU workers equals
  transformers' own Qwen3-MoE and DeepSeek-V3 (eager, float64) trained
  with torch.optim.AdamW on the same rows, labels outside the mask
  ignored, the loss the mean over the global batch's counted tokens: the
  packed rows (the default) with each example's position_ids and a
  block-diagonal causal attention mask, and the padded ones
  (--no-packing); every step's loss and gradient norm within the fp32
  bound of transformers_test.py. The same check against an oracle whose
  mask is one token late, or that attends across the packed examples,
  must fail that bound; and the response-token loss falls.

Usage: sft_test.py BIN_DIR REPO_ROOT
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardd_cluster import BETAS, EPS, LR, WEIGHT_DECAY, Cluster  # noqa: E402
from transformers_test import (FP32_BOUND, load_config, load_oracle,  # noqa
                               redraw)

BATCH, SEQ, STEPS, SEED = 8, 160, 3, 5
MASK64 = (1 << 64) - 1


# worker/data/rng.h, for the example order (worker/data/sft_source.h).
def mix64(z):
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK64
    return z ^ (z >> 31)


def stream_seed(seed, domain, index):
    h = mix64((seed + 0x9e3779b97f4a7c15 * (domain + 1)) & MASK64)
    return mix64(h ^ mix64((index + 0xd1b54a32d192ed03) & MASK64))


def epoch_order(n, seed, epoch):
    order = list(range(n))
    state = stream_seed(seed, 6, epoch)  # kSftEpoch
    for i in range(n - 1, 0, -1):
        state = (state + 0x9e3779b97f4a7c15) & MASK64
        j = (mix64(state) * (i + 1)) >> 64
        order[i], order[j] = order[j], order[i]
    return order


def read_dataset(path):
    """[(tokens, mask, line)] from the files (Megatron MMIDIDX, int32 and
    uint8)."""
    def sequences(prefix, fmt):
        with open(prefix + ".idx", "rb") as f:
            idx = f.read()
        n = struct.unpack_from("<Q", idx, 18)[0]
        lengths = struct.unpack_from(f"<{n}i", idx, 34)
        pointers = struct.unpack_from(f"<{n}q", idx, 34 + 4 * n)
        with open(prefix + ".bin", "rb") as f:
            data = f.read()
        width = struct.calcsize("<" + fmt)
        return [list(struct.unpack_from(f"<{l}{fmt}", data, p))
                for l, p in zip(lengths, pointers)]
    tokens = sequences(os.path.join(path, "tokens"), "i")
    masks = sequences(os.path.join(path, "loss_mask"), "B")
    with open(os.path.join(path, "source_lines.bin"), "rb") as f:
        raw = f.read()
    lines = struct.unpack(f"<{len(raw) // 8}q", raw)
    return list(zip(tokens, masks, lines))


def epoch_rows(examples, epoch):
    """Epoch `epoch`'s packed rows (worker/data/sft_source.h): its examples
    in order, cut greedily into rows of SEQ positions (an example of L
    tokens takes L; one of SEQ + 1 takes a row alone)."""
    rows_, cur, used = [], [], 0
    for e in epoch_order(len(examples), SEED, epoch):
        n = len(examples[e][0])
        if n == SEQ + 1:
            if cur:
                rows_.append(cur)
            rows_.append([e])
            cur, used = [], 0
        elif used + n > SEQ:
            rows_.append(cur)
            cur, used = [e], n
        else:
            cur.append(e)
            used += n
    if cur:
        rows_.append(cur)
    return rows_


def packs(examples, count):
    """The first `count` packed rows over the epochs."""
    out, epoch = [], 0
    while len(out) < count:
        out += epoch_rows(examples, epoch)
        epoch += 1
    return out[:count]


def rows(examples, step, pad, packed, late=False):
    """(inputs, targets, position_ids, attention mask) of step `step`.
    Padded: sequence k holds example order[k mod N] of epoch k / N.
    Packed: the k-th packed row, each example with its own positions and
    causal attention within it. Target j is the next token of the same
    example where it counts (with `late`, where the token after it does:
    a mask one token late), else -100; padding is its own segment."""
    n = len(examples)
    if packed:
        chosen = packs(examples, (step + 1) * BATCH)[step * BATCH:]
    else:
        chosen = [[epoch_order(n, SEED, k // n)[k % n]]
                  for k in range(step * BATCH, (step + 1) * BATCH)]
    inputs, targets, starts = [], [], []
    for group in chosen:
        inp, tgt, seg = [], [], []
        for e in group:
            tokens, mask, _ = examples[e]
            first = len(inp)
            for j in range(min(len(tokens), SEQ)):
                m = j + 2 if late else j + 1
                counted = j + 1 < len(tokens) and m < len(mask) and mask[m]
                inp.append(tokens[j])
                tgt.append(tokens[j + 1] if counted else -100)
                seg.append(first)
        pad_start = len(inp)
        while len(inp) < SEQ:
            inp.append(pad)
            tgt.append(-100)
            seg.append(pad_start)
        inputs.append(inp)
        targets.append(tgt)
        starts.append(seg)
    seg = torch.tensor(starts)
    pos = torch.arange(SEQ)
    positions = pos[None, :] - seg
    allowed = (pos[None, None, :] <= pos[None, :, None]) & (
        pos[None, None, :] >= seg[:, :, None])
    # transformers takes a custom 4D mask as additive scores (a boolean one
    # would be added as 1 and 0).
    mask = torch.where(allowed, 0.0, float("-inf")).to(torch.float64)
    return (torch.tensor(inputs), torch.tensor(targets), positions,
            mask[:, None])


def oracle_steps(model, examples, pad, packed, late=False, plain=False):
    """(loss, gradient norm) of each AdamW step: the mean cross-entropy
    over the global batch's counted targets. `plain`: causal attention
    over the whole row with positions 0..S-1 (the packing ignored)."""
    params = [w for w in model.parameters() if w.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        inputs, targets, positions, mask = rows(examples, step, pad, packed,
                                                late)
        if packed and not plain:
            logits = model(input_ids=inputs, attention_mask=mask,
                           position_ids=positions).logits
        else:
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).double(),
                               targets.flatten(), ignore_index=-100)
        loss.backward()
        norm = torch.sqrt(sum((w.grad ** 2).sum() for w in params
                              if w.grad is not None)).item()
        out.append((loss.item(), norm))
        opt.step()
    return out


def prepare(repo, args):
    return subprocess.run(
        [sys.executable, os.path.join(repo, "tools/prepare_sft.py")] + args,
        capture_output=True, text=True, timeout=300)


class Checks:
    """Prints each check as ok or FAIL and counts the failures."""

    def __init__(self):
        self.failures = 0

    def __call__(self, ok, what):
        self.failures += not ok
        print(("ok   " if ok else "FAIL ") + what)


def prepare_tiny_chat(repo, work):
    """tests/data/tiny_chat prepared into work/chat_sft; the run's result."""
    chat = os.path.join(repo, "tests/data/tiny_chat")
    dataset = os.path.join(work, "chat_sft")
    run = prepare(repo, ["--tokenizer", chat, "--input",
                         os.path.join(chat, "chat.jsonl"), "--output",
                         dataset])
    return dataset, run


def main():
    bin_dir, repo = sys.argv[1], sys.argv[2]
    chat = os.path.join(repo, "tests/data/tiny_chat")
    check = Checks()

    with tempfile.TemporaryDirectory() as work:
        dataset, run = prepare_tiny_chat(repo, work)
        print(run.stdout.strip(), run.stderr.strip())
        check(run.returncode == 0, "prepare_sft.py prepares tiny_chat")
        examples = read_dataset(dataset)
        tok = transformers.AutoTokenizer.from_pretrained(chat)
        with open(os.path.join(chat, "chat.jsonl")) as f:
            convs = [json.loads(line)["messages"] for line in f]
        ok = len(examples) == len(convs)
        for tokens, mask, line in examples:
            kept = tok.decode([t for t, m in zip(tokens, mask) if m])
            want = "".join(m["content"].lower() + "<|im_end|>\n"
                           for m in convs[line - 1] if m["role"] == "assistant")
            ok &= kept == want
        check(ok, f"the loss mask keeps exactly the assistant turns of all "
                  f"{len(examples)} conversations")

        # Bad input: the line (or flag) named, nothing written.
        bad = os.path.join(work, "bad.jsonl")
        good_line = json.dumps({"messages": convs[0]})
        cases = [
            ("not JSON", [good_line, good_line, "{\"messages\": ["],
             "line 3: not JSON"),
            ("an unknown role",
             [good_line, json.dumps({"messages": [
                 {"role": "tool", "content": "42"},
                 {"role": "assistant", "content": "ok"}]})],
             "line 2: the chat template refused the conversation"),
            ("no assistant turn",
             [json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
             "line 1: no assistant message"),
        ]
        for name, lines, message in cases:
            with open(bad, "w") as f:
                f.write("\n".join(lines) + "\n")
            out = os.path.join(work, "bad_out")
            r = prepare(repo, ["--tokenizer", chat, "--input", bad,
                               "--output", out])
            leftovers = [p for p in os.listdir(work) if p.startswith(".tmp")]
            check(r.returncode == 1 and message in r.stderr and
                  not os.path.exists(out) and not leftovers,
                  f"{name} is refused naming it ({r.stderr.strip()})")
        r = prepare(repo, ["--tokenizer", chat, "--input",
                           os.path.join(chat, "chat.jsonl"), "--output",
                           dataset])
        check(r.returncode == 1 and "--output" in r.stderr,
              "an existing --output is refused")

        pad = json.load(open(os.path.join(dataset, "shardd_sft.json")))["pad_id"]
        cluster = Cluster(bin_dir, work)
        try:
            # Qwen3-MoE (attention with q/k norms) and DeepSeek-V3 (latent
            # attention, its own RoPE); vocab 64 holds the tokenizer's 55
            # ids. Packed rows (the default) and padded (--no-packing).
            for config in ("tiny_qwen3_moe.json", "tiny_deepseek_v3.json"):
                hf_dir = os.path.join(work, config + ".hf")
                model = transformers.AutoModelForCausalLM.from_config(
                    load_config(os.path.join(repo, "tests/data", config)),
                    attn_implementation="eager", dtype=torch.float32)
                redraw(model, torch.Generator().manual_seed(3))
                model.save_pretrained(hf_dir)
                for packed in (True, False):
                    name = f"{config} {'packed' if packed else 'padded'}"
                    want = oracle_steps(load_oracle(hf_dir)[0], examples, pad,
                                        packed)
                    # Deliberate errors: a mask one token late; packed rows
                    # attended across examples with positions 0..S-1.
                    wrongs = [("a mask one token late", oracle_steps(
                        load_oracle(hf_dir)[0], examples, pad, packed,
                        late=True))]
                    if packed:
                        wrongs.append(("attention across the packed examples",
                                       oracle_steps(load_oracle(hf_dir)[0],
                                                    examples, pad, packed,
                                                    plain=True)))
                    print(f"{name}: transformers", want)
                    for world in (1, 2):
                        r = cluster.shardctl(
                            ["train", "--model", hf_dir, "--init-from", hf_dir,
                             "--data", dataset, "--seed", str(SEED), "--steps",
                             str(STEPS), "--global-batch", str(BATCH), "--seq",
                             str(SEQ), "--lr", str(LR), "--beta1",
                             str(BETAS[0]), "--beta2", str(BETAS[1]), "--eps",
                             str(EPS), "--weight-decay", str(WEIGHT_DECAY),
                             "--grad-clip", "0", "--dp", str(world),
                             "--no-mixed-precision", "--json"] +
                            ([] if packed else ["--no-packing"]))
                        got = [(x["loss"], x["grad_norm"]) for x in
                               (json.loads(line)
                                for line in r.stdout.splitlines()
                                if line.startswith('{"event":"step"'))]
                        errs = [max(abs(gl - wl) / wl, abs(gn - wn) / wn)
                                for (gl, gn), (wl, wn) in zip(got, want)]
                        check(len(got) == STEPS and max(errs) <= FP32_BOUND,
                              f"{name}, {world} worker(s): losses and gradient "
                              f"norms within {max(errs):.2e} of transformers' "
                              f"(bound {FP32_BOUND:.0e}): {got}")
                        for what, bad_steps in wrongs:
                            (gl, gn), (wl, wn) = got[0], bad_steps[0]
                            away = max(abs(gl - wl) / wl, abs(gn - wn) / wn)
                            check(away > FP32_BOUND,
                                  f"{name}, {world} worker(s): {what} is "
                                  f"{away:.2e} away at step 1 (outside the "
                                  "bound)")
            # Longer training: the response-token loss falls.
            hf_dir = os.path.join(work, "tiny_qwen3_moe.json.hf")
            r = cluster.shardctl(
                ["train", "--model", hf_dir, "--init-from", hf_dir, "--data",
                 dataset, "--steps", "20", "--global-batch", str(BATCH),
                 "--seq", str(SEQ), "--lr", "0.01", "--dp", "2", "--json"])
            curve = [json.loads(line)["loss"] for line in r.stdout.splitlines()
                     if line.startswith('{"event":"step"')]
            check(len(curve) == 20 and curve[-1] < 0.5 * curve[0],
                  f"20 steps at lr 0.01: loss {curve[0]:.3f} -> "
                  f"{curve[-1]:.3f}")
        finally:
            cluster.stop()
    print(f"{check.failures} failed")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
