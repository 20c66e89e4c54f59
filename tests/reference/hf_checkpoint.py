"""Hugging Face checkpoints written and read back for train_reference_test,
independently of shardd's own reader and writer: shardd-named float64
parameters under each architecture's published tensor names and layouts
(per-expert Linears for Mixtral and Qwen3-MoE / DeepSeek-V3, GPT-OSS's fused
interleaved experts, DiffusionGemma's released model.decoder.* layout with
per_expert_scale), in one file or an index with shards, as F32, BF16 or F16.
"""

import json
import os
import re
import struct

import torch


def write_safetensors(path, tensors):
    """tensors: name -> (dtype tag, torch tensor of that dtype)."""
    header, blobs, offset = {}, [], 0
    for name, (tag, t) in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": tag, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


DIFFUSION_GEMMA = "DiffusionGemmaForBlockDiffusion"


def diffusion_gemma_layout(params):
    """shardd -> DiffusionGemma's released names (checkpoint/hf_weights.cc):
    the text stack under model.decoder.; the router's scale and proj.weight
    under router.; each layer's experts fused, gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] (each expert a Linear weight [out, in]), with
    router.per_expert_scale, which the reader folds into the down weights:
    the scales are powers of two and the down weights are written divided
    by them, both exact, so the fold restores shardd's values. The head is
    tied (no lm_head); the encoder's layer_scalar buffers are saved again
    under model.encoder.language_model. (read by nobody)."""
    out = {}
    for name, w in params.items():
        m = re.match(r"model\.(layers\.\d+\.)moe\.(.*)", name)
        if not m:
            out["model.decoder." + name[len("model."):]] = w
            lm = re.match(r"model\.(layers\.\d+\.layer_scalar)$", name)
            if lm:
                out["model.encoder.language_model." + lm.group(1)] = w.clone()
            continue
        pre, rest = "model.decoder." + m.group(1), m.group(2)
        if rest.startswith("gate."):
            out[pre + "router." + rest[len("gate."):]] = w
        elif rest == "experts.gate_and_up_projs":  # [E, D, 2I]
            out[pre + "experts.gate_up_proj"] = w.transpose(1, 2)
        elif rest == "experts.down_projs":  # [E, I, D]
            scale = torch.tensor([2.0 ** ((e % 3) - 1)
                                  for e in range(w.shape[0])]).to(w.dtype)
            out[pre + "router.per_expert_scale"] = scale
            out[pre + "experts.down_proj"] = (
                w.transpose(1, 2) / scale[:, None, None])
        else:
            raise ValueError(f"no DiffusionGemma name for {name}")
    return out


def hf_layout(params, architecture, inter_of):
    """shardd names and layouts -> Hugging Face's, as published."""
    if architecture == DIFFUSION_GEMMA:
        return diffusion_gemma_layout(params)
    out = {}
    for name, w in params.items():
        m = re.match(r"(model\.layers\.\d+\.)moe\.(.*)", name)
        if not m:
            out[name] = w
            continue
        pre, rest = m.groups()
        if architecture == "GptOssForCausalLM":
            if rest in ("experts.gate_and_up_projs", "experts.gate_up_proj_bias"):
                i = w.shape[-1] // 2
                fused = torch.stack((w[..., :i], w[..., i:]), dim=-1).flatten(-2)
                key = "gate_up_proj" if rest.endswith("projs") else "gate_up_proj_bias"
                out[pre + "mlp.experts." + key] = fused
            elif rest == "experts.down_projs":
                out[pre + "mlp.experts.down_proj"] = w
            elif rest.startswith("gate."):
                out[pre + "mlp.router." + rest[len("gate."):]] = w
            else:
                out[pre + "mlp." + rest] = w
            continue
        mixtral = architecture == "MixtralForCausalLM"
        module = "block_sparse_moe" if mixtral else "mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        if rest == "experts.gate_and_up_projs":  # [E, D, 2I]
            i = inter_of[pre]
            for e in range(w.shape[0]):
                out[f"{pre}{module}.experts.{e}.{names[0]}.weight"] = w[e, :, :i].T
                out[f"{pre}{module}.experts.{e}.{names[1]}.weight"] = w[e, :, i:].T
        elif rest == "experts.down_projs":  # [E, I, D]
            for e in range(w.shape[0]):
                out[f"{pre}{module}.experts.{e}.{names[2]}.weight"] = w[e].T
        else:
            out[pre + module + "." + rest] = w
    return out


def save_hf(directory, params, architecture, dtype, shards):
    """Writes params (shardd names, float64) as an HF checkpoint in `dtype`;
    returns the float64 values the checkpoint holds, under shardd names."""
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16,
                   "F16": torch.float16}[dtype]
    stored = {n: w.to(torch_dtype) for n, w in params.items()}
    inter_of = {}
    for n, w in params.items():
        m = re.match(r"(model\.layers\.\d+\.)moe\.experts\.down_projs", n)
        if m:
            inter_of[m.group(1)] = w.shape[1]
    hf = hf_layout(stored, architecture, inter_of)
    names = sorted(hf)
    groups = [names[k::shards] for k in range(shards)]
    os.makedirs(directory, exist_ok=True)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"),
                          {n: (dtype, hf[n]) for n in names})
    else:
        weight_map = {}
        for k, group in enumerate(groups):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(os.path.join(directory, file),
                              {n: (dtype, hf[n]) for n in group})
            weight_map.update({n: file for n in group})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    # What the workers read: all but the encoder's unread copies.
    total_bytes = sum(hf[n].numel() * hf[n].element_size() for n in names
                      if not n.startswith("model.encoder."))
    return {n: w.to(torch.float64) for n, w in stored.items()}, total_bytes


def read_safetensors(path):
    """name -> float64 tensor of one safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16,
              "F16": torch.float16}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(blob[8 + n + a: 8 + n + b]),
                                     dtype=dtypes[t["dtype"]]).view(
                                         t["shape"]).to(torch.float64)
    return out


def read_diffusion_gemma(directory, names):
    """An exported DiffusionGemma checkpoint back to shardd's names (the
    inverse of diffusion_gemma_layout, per_expert_scale folded)."""
    hf = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            hf.update(read_safetensors(os.path.join(directory, file)))
    out = {}
    for name in names:
        m = re.match(r"model\.(layers\.\d+\.)moe\.(.*)", name)
        if not m:
            out[name] = hf["model.decoder." + name[len("model."):]]
            continue
        pre, rest = "model.decoder." + m.group(1), m.group(2)
        if rest.startswith("gate."):
            out[name] = hf[pre + "router." + rest[len("gate."):]]
        elif rest == "experts.gate_and_up_projs":
            out[name] = hf[pre + "experts.gate_up_proj"].transpose(1, 2)
        else:
            scale = hf[pre + "router.per_expert_scale"]
            out[name] = (hf[pre + "experts.down_proj"]
                         * scale[:, None, None]).transpose(1, 2)
    return out
