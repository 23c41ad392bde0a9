"""A GGUF file's quantized weights as they are, without dequantizing: Q4_0 / Q4_1 blocks as
int4 groupwise codes with the file's own groups of 32 (bit for bit), Q8_0 as int8.

Names: transformers' own GGUF name map (`get_gguf_hf_weights_map`) gives each GGUF tensor
its HF parameter name. Some architectures store rows in another order (llama.cpp permutes
the q/k rows of Llama for its rotary layout); transformers undoes that with a per-arch
tensor processor on the dequantized array. We run the same processor on a column of row
indices to learn the row order, then reorder the quantized rows, which is exact because a
block never spans two rows. A tensor whose processing is not a pure row reordering is left
out (it stays dequantized).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.layers.quantization.pack import Int4Weight, Int8Weight, quantize_int8
from engine.worker.cache_paths import gguf_cache_dir

log = logging.getLogger(__name__)

BLOCK = 32  # values per block in Q4_0, Q4_1 and Q8_0
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _f16(block: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(block[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """16 bytes per block -> 32 codes: the low nibbles are values 0..15, the high ones 16..31."""
    return torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32))


def int4_from_q4(raw: np.ndarray, kind: str, k: int) -> Int4Weight:
    """raw: [N, bytes] of Q4_0 (18-byte blocks) or Q4_1 (20-byte blocks)."""
    n = raw.shape[0]
    width = 18 if kind == "Q4_0" else 20
    blocks = raw.reshape(n, k // BLOCK, width)
    d = _f16(blocks, 0)
    if kind == "Q4_0":  # w = d * (q - 8)
        return Int4Weight(_nibbles(blocks[..., 2:]).reshape(n, k), d, torch.zeros_like(d), BLOCK)
    m = _f16(blocks, 2)  # Q4_1: w = d * q + m = (q - 8) * d + (m + 8 d)
    return Int4Weight(_nibbles(blocks[..., 4:]).reshape(n, k), d, m + 8.0 * d, BLOCK)


def int8_from_q8_0(raw: np.ndarray, k: int) -> Int8Weight:
    """Q8_0 has a scale per 32 values, the int8 kernel one per row: re-quantize the row from
    its exact values (lossy: codes of groups with a smaller scale than the row's max lose bits)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // BLOCK, 2 + BLOCK)
    d = _f16(blocks, 0)
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.float32))
    return quantize_int8((q * d[..., None]).reshape(n, k))


def read_native(gguf_path: Path, model: Any) -> dict[str, Int4Weight | Int8Weight]:
    """HF parameter name -> the file's quantized weight, for every 2-D Q4_0/Q4_1/Q8_0 tensor.
    Parsing the GGUF (its vocabulary above all) takes seconds: the result is cached on disk
    in a subfolder of the converted safetensors folder."""
    cache = native_cache(gguf_path)
    if cache.is_file():
        return _load_cache(cache)
    weights = _read(gguf_path, model)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    _save_cache(weights, tmp)
    tmp.replace(cache)  # atomic: a crash never leaves half a cache
    return weights


def native_cache(gguf_path: Path) -> Path:
    """Where read_native keeps its cache: NOT beside model.safetensors, because other loaders
    (vLLM's above all, which the benchmarks point at the converted folder) load every
    top-level *.safetensors of a checkpoint folder. A cache an earlier version left there is
    moved."""
    folder = gguf_cache_dir(gguf_path)
    cache = folder / "native" / "weights.safetensors"
    legacy = folder / "native-weights.safetensors"
    if legacy.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        legacy.replace(cache)
    return cache


def _read(gguf_path: Path, model: Any) -> dict[str, Int4Weight | Int8Weight]:
    from gguf import GGUFReader
    from tqdm import tqdm
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = _name_map(arch, model)
    out: dict[str, Int4Weight | Int8Weight] = {}
    for tensor in tqdm(reader.tensors, desc=f"reading {gguf_path.name} quantized", unit="tensor"):
        kind = tensor.tensor_type.name
        if kind not in NATIVE_TYPES or len(tensor.shape) != 2:
            continue
        k, n = (int(s) for s in tensor.shape)  # GGUF lists dims innermost first
        order = _row_order(processor, tensor.name, n, names)
        if order is None:
            continue
        hf_name, rows = order
        raw = np.asarray(tensor.data)
        weight = int8_from_q8_0(raw, k) if kind == "Q8_0" else int4_from_q4(raw, kind, k)
        out[hf_name] = weight if rows is None else weight.permute_rows(rows)
    log.info("GGUF %s: %d quantized tensors kept as they are", gguf_path.name, len(out))
    return out


def _field(reader: Any, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def _name_map(arch: str, model: Any) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf's own table (built once: transformers'
    get_gguf_hf_weights_map rebuilds it for every submodule, a minute on this box)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        return {}
    table = get_tensor_name_map(arch_id, model.config.get_text_config().num_hidden_layers)
    out: dict[str, str] = {}
    for hf_name in model.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        for candidate in (stem, stem.partition(".")[2]):  # with and without "model."
            gguf_name = table.get_name(candidate) if candidate else None
            if gguf_name is not None:
                out.setdefault(f"{gguf_name}.{suffix}", hf_name)
                break
    return out


def _save_cache(weights: dict[str, Int4Weight | Int8Weight], path: Path) -> None:
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight):
            flat[f"{name}.int4_codes"] = w.codes.to(torch.uint8)
            flat[f"{name}.int4_zero"] = w.zero
        else:
            flat[f"{name}.int8_codes"] = w.codes
        flat[f"{name}.scale"] = w.scale.contiguous()
    save_file(flat, str(path))


def _load_cache(path: Path) -> dict[str, Int4Weight | Int8Weight]:
    from safetensors.torch import load_file

    flat = load_file(str(path))
    out: dict[str, Int4Weight | Int8Weight] = {}
    for key in flat:
        if key.endswith(".int4_codes"):
            name = key.removesuffix(".int4_codes")
            out[name] = Int4Weight(flat[key].to(torch.int32), flat[f"{name}.scale"],
                                   flat[f"{name}.int4_zero"], BLOCK)
        elif key.endswith(".int8_codes"):
            name = key.removesuffix(".int8_codes")
            out[name] = Int8Weight(flat[key], flat[f"{name}.scale"])
    return out


def _row_order(processor: Any, name: str, n: int,
               names: dict[str, str]) -> tuple[str, torch.Tensor | None] | None:
    """(HF name, row order or None for identity) or None when the tensor can't be kept."""
    index = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        result = processor.process(weights=index, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}, "config": {}})
    except Exception:  # noqa: BLE001 - an arch whose processor needs more than rows
        return None
    if result is None or result.name not in names or np.shape(result.weights) != (n, 1):
        return None
    rows = np.asarray(result.weights)[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(rows), np.arange(n)):
        return None
    if np.array_equal(rows, np.arange(n)):
        return names[result.name], None
    return names[result.name], torch.from_numpy(rows)
