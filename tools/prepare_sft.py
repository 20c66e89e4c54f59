#!/usr/bin/env python3
"""Turns chat JSONL into a shardd SFT dataset (docs/sft_data.md).

    prepare_sft.py --tokenizer DIR --input chat.jsonl --output DATASET_DIR

Each input line is a JSON object with "messages": a list of {"role",
"content"} (system, user, assistant, or whatever roles the tokenizer's chat
template knows). The conversation is rendered with the tokenizer's own chat
template and tokenized with the tokenizer itself (transformers'
AutoTokenizer from a local directory: a model's, or any tokenizer directory
the user names). Only the assistant turns count in the loss: their content
and the template's end-of-turn text after it, as the model is to produce
them. The dataset holds, per example, the tokens, that loss mask and the
input line it came from, in Megatron's indexed-dataset layout (.bin +
.idx), with a manifest of sizes and checksums that the workers verify on
open. The output directory appears only once complete.

Needs transformers and tokenizers (the tests' environment,
tools/python-requirements.txt) and libxxhash (shardd's own dependency).
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import struct
import sys
import tempfile

FORMAT = "shardd-sft"
VERSION = 1
MANIFEST = "shardd_sft.json"
CHUNK_BYTES = 1 << 20
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_INT32 = 4
MEGATRON_UINT8 = 1


class PrepareError(Exception):
    pass


def xxh64_chunks(path):
    """XXH64 (seed 0) of each CHUNK_BYTES piece of the file, as hex."""
    name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise PrepareError(f"libxxhash is needed for the checksums: {e}")
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    out = []
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            out.append("%016x" % lib.XXH64(chunk, len(chunk), 0))
    return out


def write_indexed(prefix, arrays, dtype_code, item_format):
    """Megatron's MMIDIDX version 1: one sequence and one document per array."""
    width = struct.calcsize("<" + item_format)
    pointers = []
    offset = 0
    with open(prefix + ".bin", "wb") as f:
        for a in arrays:
            pointers.append(offset)
            f.write(struct.pack("<%d%s" % (len(a), item_format), *a))
            offset += len(a) * width
    with open(prefix + ".idx", "wb") as f:
        f.write(MEGATRON_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(arrays)))
        f.write(struct.pack("<Q", len(arrays) + 1))
        f.write(struct.pack("<%di" % len(arrays), *[len(a) for a in arrays]))
        f.write(struct.pack("<%dq" % len(arrays), *pointers))
        f.write(struct.pack("<%dq" % (len(arrays) + 1), *range(len(arrays) + 1)))


def render(tokenizer, messages, generation_prompt):
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_example(tokenizer, messages, line):
    """(token ids, loss mask) of one conversation."""
    if not isinstance(messages, list) or not messages:
        raise PrepareError(f"line {line}: \"messages\" must be a non-empty list")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str) or
                not isinstance(m.get("content"), str)):
            raise PrepareError(
                f"line {line}: messages[{i}] must be an object with string "
                "\"role\" and \"content\"")
    try:
        text = render(tokenizer, messages, False)
    except Exception as e:  # The template's own refusal (an unknown role).
        raise PrepareError(f"line {line}: the chat template refused the "
                           f"conversation: {e}")
    for i, m in enumerate(messages):
        if m["content"] and m["content"] not in text:
            raise PrepareError(
                f"line {line}: messages[{i}] (role '{m['role']}') does not "
                "appear in the chat template's rendering: the template does "
                "not know that role")
    # Each assistant turn's characters: from the end of the prompt that
    # precedes it (with the generation prompt) to the end of the rendering
    # that includes it.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], True) if i else ""
        through = render(tokenizer, messages[:i + 1], False)
        if not text.startswith(through) or not through.startswith(before):
            raise PrepareError(
                f"line {line}: the chat template renders messages[{i}] "
                "differently as a prefix than in the whole conversation, so "
                "its tokens cannot be told apart")
        spans.append((len(before), len(through)))
    if not spans:
        raise PrepareError(f"line {line}: no assistant message: nothing to "
                           "train on")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [1 if any(lo <= s < hi for lo, hi in spans) else 0
            for s, _ in offsets]
    return ids, mask


def prepare(args):
    import transformers  # Slow to import: after the argument checks.
    if os.path.exists(args.output):
        raise PrepareError(f"--output: {args.output} already exists")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    except Exception as e:
        raise PrepareError(f"--tokenizer: cannot load {args.tokenizer}: {e}")
    if not getattr(tokenizer, "is_fast", False):
        raise PrepareError("--tokenizer: needs a fast tokenizer "
                           "(tokenizer.json) for the character offsets")
    if tokenizer.chat_template is None:
        raise PrepareError(f"--tokenizer: {args.tokenizer} has no chat "
                           "template")
    vocab = len(tokenizer)
    tokens, masks, lines = [], [], []
    with open(args.input, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{args.input}: line {number}: not JSON: {e}")
            if not isinstance(record, dict) or "messages" not in record:
                raise PrepareError(f"{args.input}: line {number}: expected an "
                                   "object with \"messages\"")
            try:
                ids, mask = encode_example(tokenizer, record["messages"], number)
            except PrepareError as e:
                raise PrepareError(f"{args.input}: {e}")
            if args.max_tokens and len(ids) > args.max_tokens:
                raise PrepareError(
                    f"{args.input}: line {number}: {len(ids)} tokens, more "
                    f"than --max-tokens {args.max_tokens}")
            tokens.append(ids)
            masks.append(mask)
            lines.append(number)
    if not tokens:
        raise PrepareError(f"{args.input}: no examples")
    parent = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-sft-", dir=parent)
    try:
        write_indexed(os.path.join(tmp, "tokens"), tokens, MEGATRON_INT32, "i")
        write_indexed(os.path.join(tmp, "loss_mask"), masks, MEGATRON_UINT8,
                      "B")
        with open(os.path.join(tmp, "source_lines.bin"), "wb") as f:
            f.write(struct.pack("<%dq" % len(lines), *lines))
        files = {}
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            files[name] = {"bytes": os.path.getsize(path),
                           "xxh64": xxh64_chunks(path)}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "vocab_size": vocab,
            "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id
                      is not None else 0,
            # DiffusionGemma pads each response with it to its blocks.
            "eos_id": tokenizer.eos_token_id,
            "tokenizer": os.path.abspath(args.tokenizer),
            "source": os.path.abspath(args.input),
            "examples": len(tokens),
            "tokens": sum(len(t) for t in tokens),
            "counted_tokens": sum(sum(m) for m in masks),
            "max_example_tokens": max(len(t) for t in tokens),
            "chunk_bytes": CHUNK_BYTES,
            "files": files,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        os.rename(tmp, args.output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True,
                        help="a local tokenizer directory (a model's)")
    parser.add_argument("--input", required=True, help="chat JSONL")
    parser.add_argument("--output", required=True,
                        help="the dataset directory to create")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="refuse longer examples (0: no bound)")
    args = parser.parse_args(argv)
    if args.max_tokens < 0:
        parser.error("--max-tokens: must be >= 0")
    try:
        m = prepare(args)
    except PrepareError as e:
        print(f"prepare_sft: {e}", file=sys.stderr)
        return 1
    print(f"prepare_sft: {m['examples']} examples, {m['tokens']} tokens "
          f"({m['counted_tokens']} in the loss), longest "
          f"{m['max_example_tokens']}, into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
