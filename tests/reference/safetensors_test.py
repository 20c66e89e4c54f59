"""The safetensors library as a second reader and writer of shardd's files.

Files the library writes (`safetensors.torch.save_file`) load into shardd:
a tiny Qwen3-MoE's weights (per-expert names, as transformers writes them)
in each dtype `--init-from` accepts (F32, BF16, F16), in one file and in
shards with a model.safetensors.index.json. Each is trained for one step
with a learning rate (1e-30) that moves no weight of magnitude above 2^-75
(every weight here), over 2 workers, dim-0 (default) and flat
(megatron_fsdp) shards. Then:

- every file of the checkpoint shardd saved opens with the library, every
  tensor the index lists is in its file with the index's dtype and element
  count, and the chunks of each parameter put together are the weights
  written, widened to F32, bit for bit;
- `checkpoint export --hf` writes files the library opens, with the names
  and shapes written and those weights bit for bit.

A file the library writes in a dtype shardd does not read (F64) is refused
with an error naming the tensor and the dtypes allowed.

Usage: safetensors_test.py BIN_DIR CONFIG.json
"""

import json
import os
import struct
import sys
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardd_cluster import BATCH, SEQ, STEPS, Cluster  # noqa: E402
from transformers_test import (load_config, redraw,  # noqa: E402
                               safetensors_files)

TINY_LR = "1e-30"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
TORCH_TAG = {torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float16: "F16", torch.float64: "F64"}


def write(directory, tensors, shards):
    """tensors written with save_file: one model.safetensors, or `shards`
    files and the index transformers would write for them."""
    os.makedirs(directory)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(directory, file),
                  metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"),
              "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": weight_map}, f)


def same_bits(a, b):
    """a and b (F32) hold the same bit patterns (NaNs and signed zeros
    included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def read_checkpoint(directory):
    """{name: (dtype tag, F32 tensor put together from its chunks)} of a
    shardd checkpoint, read with the library only; and the problems found."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    files, problems = {}, []
    for record in index["files"]:
        path = os.path.join(directory, record["name"])
        if os.path.getsize(path) != record["size"]:
            problems.append(f"{record['name']}: size differs from the index")
        files[record["name"]] = safe_open(path, "pt")
    out = {}
    for name, t in index["tensors"].items():
        numel = 1
        for d in t["shape"]:
            numel *= d
        flat = torch.full((numel,), float("nan"))
        covered = 0
        for c in t["chunks"]:
            piece = files[c["file"]].get_tensor(c["tensor"])
            tag = TORCH_TAG.get(piece.dtype, str(piece.dtype))
            if tag != t["dtype"] or piece.numel() != c["end"] - c["begin"]:
                problems.append(f"{name}: chunk {c['tensor']} in {c['file']} "
                                f"is {tag} x {piece.numel()}, the index says "
                                f"{t['dtype']} x {c['end'] - c['begin']}")
                continue
            flat[c["begin"]:c["end"]] = piece.flatten().float()
            covered += piece.numel()
        if covered != numel:
            problems.append(f"{name}: chunks cover {covered} of {numel}")
        out[name] = (t["dtype"], flat.view(t["shape"]))
    return out, problems


def read_hf(directory):
    """{name: tensor} of every safetensors file in a directory."""
    out = {}
    for path in safetensors_files(directory):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def main():
    bin_dir, config = sys.argv[1], sys.argv[2]
    failures, checks = 0, 0

    def check(ok, text):
        nonlocal failures, checks
        checks += 1
        failures += not ok
        print(f"  {'ok' if ok else 'FAIL'} {text}")

    with tempfile.TemporaryDirectory() as work:
        gen = torch.Generator().manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(
            load_config(config), dtype=torch.float32)
        redraw(model, gen)
        # The names and per-expert layout transformers writes.
        hf_dir = os.path.join(work, "hf")
        model.save_pretrained(hf_dir)
        weights = read_hf(hf_dir)
        vocab = model.config.vocab_size
        tokens = torch.randint(0, vocab, (STEPS * BATCH * SEQ + 1,),
                               generator=gen).tolist()
        data = os.path.join(work, "tokens.bin")
        with open(data, "wb") as f:
            f.write(struct.pack(f"<{len(tokens)}H", *tokens))
        cluster = Cluster(bin_dir, work)
        try:
            for tag, dtype in DTYPES.items():
                for shards in (1, 3):
                    for strategy in ("default", "megatron_fsdp"):
                        label = f"{tag} in {shards} file(s), {strategy}"
                        written = {n: w.to(dtype) for n, w in weights.items()}
                        src = os.path.join(work, f"{tag}.{shards}.{strategy}")
                        write(src, written, shards)
                        want = {n: w.float() for n, w in written.items()}
                        run = cluster.shardctl([
                            "train", "--model", hf_dir, "--init-from", src,
                            "--data", data, "--steps", "1", "--global-batch",
                            str(BATCH), "--seq", str(SEQ), "--lr", TINY_LR,
                            "--weight-decay", "0", "--grad-clip", "0",
                            "--dp", "2", "--strategy", strategy,
                            "--checkpoint-every", "1", "--json"])
                        saved = [json.loads(line)["checkpoint"]
                                 for line in run.stdout.splitlines()
                                 if line.startswith('{"event":"step"')]
                        ckpt = os.path.join(cluster.checkpoints, saved[-1])
                        got, problems = read_checkpoint(ckpt)
                        params = {n: t for n, (_, t) in got.items()
                                  if "/" not in n}
                        moments = len(got) - len(params)
                        check(not problems and moments == 2 * len(params),
                              f"{label}: the checkpoint's "
                              f"{len(os.listdir(ckpt)) - 1} files open with "
                              f"safetensors; {len(got)} tensors match "
                              f"index.json ({problems[:3] or 'no problem'})")
                        # shardd's names differ from HF's (stacked experts):
                        # compare through the export, and the element
                        # multiset of the parameters here.
                        got_sorted = torch.sort(torch.cat(
                            [t.flatten() for t in params.values()])).values
                        want_sorted = torch.sort(torch.cat(
                            [t.flatten() for t in want.values()])).values
                        check(same_bits(got_sorted, want_sorted),
                              f"{label}: the checkpoint's parameters are the "
                              f"{want_sorted.numel()} weights written, bit "
                              "for bit")
                        out = os.path.join(work, f"export.{label}".replace(
                            " ", "_"))
                        cluster.shardctl_local(["checkpoint", "export",
                                                "--checkpoint", ckpt,
                                                "--hf", out])
                        exported = read_hf(out)
                        bad = sorted(n for n in want if n not in exported or
                                     not same_bits(exported[n].float(),
                                                   want[n]))
                        extra = sorted(set(exported) - set(want))
                        check(not bad and not extra,
                              f"{label}: the export's {len(exported)} tensors "
                              f"open with safetensors, under the names "
                              f"written, bit for bit (differ: {bad[:3]}, "
                              f"extra: {extra[:3]})")
            # A dtype --init-from does not read.
            src = os.path.join(work, "F64")
            write(src, {n: w.double() for n, w in weights.items()}, 1)
            run = cluster.shardctl([
                "train", "--model", hf_dir, "--init-from", src, "--data",
                data, "--steps", "1", "--global-batch", str(BATCH), "--seq",
                str(SEQ), "--dp", "1"], check=False)
            message = run.stdout + run.stderr
            check(run.returncode != 0 and "F64" in message and "F32" in message,
                  "an F64 file is refused by name: "
                  + (message.strip().splitlines() or ["(nothing)"])[-1][:200])
        finally:
            cluster.stop()
    print(f"{checks} checks; {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
