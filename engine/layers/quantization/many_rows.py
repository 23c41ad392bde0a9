"""Quantized matmuls for steps of many token rows (csrc/quant_mm.cpp), beside torch's kernels.

torch's CPU int4/int8 kernels unpack the weights again for every few token rows, so their
time grows with the step: at a 1B model's shapes they win up to ~8 rows and are 5x slower
than a dense bf16 GEMM at 64. Ours dequantize each tile of the weights once into the L2
cache and multiply every row by it with the CPU's bf16 matrix micro-kernel (AMX where there
is one), reading the same buffers as torch's kernels: at 16+ rows they run about as fast as
the dense GEMM (docs/memory.md), so a quantized model needs no dense copy of its weights.

Built on first use like the attention kernel (engine/attention/cpu_kernels.py). Without a
compiler, or on a CPU without the bf16 micro-kernel, `available()` is False and the
quantized modules keep a dense copy for large steps instead (engine/layers/quantization/quant.py).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from engine.attention.cpu_kernels import load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "quant_mm.cpp"
# Above this many token rows a quantized linear takes our kernel, at or below it torch's:
# the crossover measured at 1B and 135M shapes for int4 and int8 (docs/memory.md).
MANY_ROWS_ABOVE = 8


@functools.cache
def available() -> bool:
    """Whether the library built and this CPU has its bf16 micro-kernel."""
    if load_library(SOURCE, "many-row quantized matmul", "dense copies for large steps") is None:
        return False
    try:
        _register_fakes()
        return bool(torch.ops.pagedserve_quant.available())
    except (RuntimeError, AttributeError) as exc:  # a torch without these APIs: the fallback
        log.warning("many-row quantized matmul unusable, keeping dense copies: %s", exc)
        return False


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times torch's int4 CPU layout ([N, K / 2] uint8, [K / group, N, 2]
    scales and zeros) -> [M, N] bf16; only after available() returned True."""
    return torch.ops.pagedserve_quant.int4_mm(x, packed, group_size, scales_and_zeros)


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times int8 codes [N, K] with a scale per row [N] -> [M, N] bf16."""
    return torch.ops.pagedserve_quant.int8_mm(x, codes, scales)


def _register_fakes() -> None:
    """Shapes for torch.compile, which traces the quantized modules in the compiled step."""

    @torch.library.register_fake("pagedserve_quant::int4_mm")
    def _int4(x: torch.Tensor, packed: torch.Tensor, group_size: int,
              scales_and_zeros: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("pagedserve_quant::int8_mm")
    def _int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])
