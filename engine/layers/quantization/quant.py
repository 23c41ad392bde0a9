"""`--quantization`: which linear layers of a loaded HF model become int4/int8 modules.

- `none`: dense weights (a GGUF file is dequantized, as before).
- `auto` (default): in bfloat16, a GGUF file keeps its own quantization where a kernel exists
  (Q4_0/Q4_1 -> int4 with the file's groups of 32, bit for bit; Q8_0 -> int8); other tensor
  types are dequantized. A safetensors model stays dense, and so does every model in another
  dtype: the kernels compute in bfloat16 (KERNEL_DTYPE), and a user who asks for float32
  asks for float32 arithmetic, the one whose greedy tokens equal HF's whatever the batch.
- `int8`: every linear (lm_head included) int8 with a scale per output row.
- `w8a8`: int8's weights, and the decoder linears' activations quantized per token for
  steps of more than 8 rows, whose products become int8 GEMMs (W8A8Linear); lm_head stays
  weight-only int8, as in int4.
- `int4`: every decoder linear int4 groupwise (a GGUF's Q4 tensors as they are, other weights
  quantized at load with groups of INT4_GROUP_SIZE); lm_head int8, because the output layer
  is the most sensitive to 4 bits and (like llama.cpp's Q4 files, which keep it at 6-8 bits).

The embedding lookup always stays dense: it reads a handful of rows per step. With tied
embeddings the lm_head's dense copy IS the embedding tensor, so it costs nothing (until
engine/layers/packed_linear.py packs the dense copies, in bf16 on the CPU: the head's is then its own).

One resident copy of each weight: a quantized module serves steps of every size from its
quantized buffers, torch's kernels for a few token rows and our many-row kernel above
(engine/layers/quantization/many_rows.py), which runs about as fast as a dense GEMM there. Only where
that kernel is unavailable (no compiler, no bf16 micro-kernel on the CPU) does each module
keep its dense weight for steps of more than DENSE_ABOVE_ROWS rows, since torch's kernels
slow down with the rows; the memory this costs is logged at load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from engine.layers.quantization import many_rows
from engine.layers.quantization.linear import KERNEL_DTYPE, Int4Linear, Int8Linear, W8A8Linear
from engine.layers.quantization.pack import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from engine.worker.file_pages import mapped_checkpoints, release_freed, release_pages

log = logging.getLogger(__name__)

MODES = ("auto", "none", "int8", "int4", "w8a8")
INT4_GROUP_SIZE = 32  # groups of 32: perplexity +% vs 64 in docs/quantization.md
DENSE_ABOVE_ROWS = 8  # without the many-row kernel: the crossover measured, docs/memory.md


def resolve_mode(mode: str, gguf: bool, device: torch.device, dtype: torch.dtype,
                 batch_invariant: bool) -> str:
    """The mode that actually applies: `auto` on a safetensors model, on CUDA (the int4/int8
    kernels used here are the CPU ones), in batch-invariant mode or in a dtype other than the
    kernels' own (bfloat16) is `none`: auto never changes the arithmetic the dtype asked for."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}")
    if mode == "auto":
        keeps = gguf and device.type == "cpu" and dtype == KERNEL_DTYPE and not batch_invariant
        return "auto" if keeps else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantization {mode} is implemented for the CPU only")
    if mode != "none" and batch_invariant:
        raise ValueError(f"--quantization {mode} cannot be combined with --batch-invariant")
    return mode


def quantize_model(model: Any, mode: str, gguf: Path | None,
                   dense_above: int | None | Literal["auto"] = "auto") -> int:
    """Replace the model's linears per `mode` (already resolved); returns how many were
    replaced. `dense_above=None` drops the dense copies (least memory, quantized always),
    an int keeps them for steps above that many rows, and "auto" keeps them only where the
    many-row kernel is unavailable."""
    if mode == "none":
        return 0
    if dense_above == "auto":
        dense_above = None if many_rows.available() else DENSE_ABOVE_ROWS
    native = _native(gguf, model)
    if mode == "auto" and not native:
        return 0
    head = model.get_output_embeddings()
    tied_to = model.get_input_embeddings().weight if head.weight is model.get_input_embeddings().weight else None
    replaced, extra = 0, 0
    mapped = mapped_checkpoints()
    # Names, not modules: a list of the modules would keep every replaced dense weight alive
    # to the end (the peak at load, docs/memory.md).
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        module = model.get_submodule(name)
        is_head = module is head
        key = "model.embed_tokens.weight" if is_head and tied_to is not None else f"{name}.weight"
        weight = _choose(mode, native.get(key) or native.get(f"{name}.weight"), module.weight,
                         is_head)
        if weight is None:
            continue
        new = _module(weight, module, dense_above, w8a8=mode == "w8a8" and not is_head)
        _set_module(model, name, new)
        if dense_above is None and module.weight is not tied_to:
            release_pages(module.weight, mapped)  # read once, now held as `weight`
        replaced += 1
        extra += sum(b.numel() * b.element_size() for b in new.buffers())
        # The replaced weight and the quantizer's temporaries, freed into the heap, go back
        # to the OS module by module: left there, the next module's larger ones stacked up
        # beside them and the peak at load varied from run to run by over 1 GB (int8, 1B).
        del module, weight, new
        release_freed()
    kept = "one copy: no dense weights beside them" if dense_above is None else \
        f"dense copies kept for steps above {dense_above} rows"
    computes = str(KERNEL_DTYPE).removeprefix("torch.")
    log.info("quantization %s: %d linears replaced, +%.1f MB of quantized weights (%s); the "
             "quantized kernels compute in %s%s", mode, replaced, extra / 2**20, kept, computes,
             _dtype_note(getattr(model, "dtype", KERNEL_DTYPE)))
    return replaced


def _dtype_note(model_dtype: torch.dtype) -> str:
    """The warning a user of another dtype needs: the kernels do not compute in it."""
    if model_dtype == KERNEL_DTYPE:
        return ""
    name = str(model_dtype).removeprefix("torch.")
    return (f", not the model's {name}: greedy tokens can differ from a dense {name} run's and "
            f"change with the batch (--quantization none keeps {name} arithmetic)")


def _native(gguf: Path | None, model: Any) -> dict[str, Int4Weight | Int8Weight]:
    if gguf is None:
        return {}
    from engine.layers.quantization.gguf import read_native

    return read_native(gguf, model)


def _choose(mode: str, native: Int4Weight | Int8Weight | None, dense: torch.Tensor,
            is_head: bool) -> Int4Weight | Int8Weight | None:
    if mode == "auto":
        return native
    if dense.shape[1] % 2:  # torch's int8 kernel crashed the process on an odd K (4 rows)
        log.warning("%s: %s has an odd in_features: kept dense", mode, tuple(dense.shape))
        return None
    if mode in ("int8", "w8a8") or is_head:
        return native if isinstance(native, Int8Weight) else quantize_int8(dense)
    if isinstance(native, Int4Weight):
        return native
    if dense.shape[1] % INT4_GROUP_SIZE:
        log.warning("int4: %s has in_features %d, not a multiple of %d: kept int8",
                    tuple(dense.shape), dense.shape[1], INT4_GROUP_SIZE)
        return quantize_int8(dense)
    return quantize_int4(dense, INT4_GROUP_SIZE)


def _module(weight: Int4Weight | Int8Weight, old: nn.Linear,
            dense_above: int | None, w8a8: bool = False) -> nn.Module:
    if w8a8:  # its many-row path is the int8 GEMM: never a dense copy
        assert isinstance(weight, Int8Weight), "w8a8 takes int8 weights"
        return W8A8Linear(weight, old.bias).to(old.weight.device)
    dense = None if dense_above is None else old.weight
    rows = dense_above or 0
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, old.bias, dense, rows).to(old.weight.device)
    return Int8Linear(weight, old.bias, dense, rows).to(old.weight.device)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
