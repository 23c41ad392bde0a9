"""Weight-only quantized tensors in the layouts of torch's CPU kernels.

Two kernels, both weight-only (activations stay floating point):

- int4 groupwise, `aten._weight_int4pack_mm_for_cpu`: 4-bit codes q in [0, 15] packed two per
  byte by `aten._convert_weight_to_int4pack_for_cpu`, and per (group of K, output row) a
  (scale, zero) pair with the kernel's dequantization w = (q - 8) * scale + zero. A GGUF
  Q4_1 block (w = d * q + m) is scale = d, zero = m + 8 d; Q4_0 (w = d * (q - 8)) is
  scale = d, zero = 0. Checked bitwise against gguf's own dequantization through the kernel
  (tests/engine/test_quant.py).
- int8 per output channel, `aten._weight_int8pack_mm`: w = q * scale[row]. The kernel has
  one scale per row only, so a GGUF Q8_0 tensor (a scale per 32 values) is re-quantized
  per row from its exact values: that is the one lossy step, stated in engine/layers/quantization/quant.py.

Both kernels want the scales in the activation dtype, and on an AVX2 CPU without native
bf16 their float32-activation path is 10-20x slower than their bfloat16 one (measured,
docs/quantization.md): the modules in engine/layers/quantization/linear.py run them in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """Codes q [N, K] (int32 in 0..15) with scale and zero [N, K // group] (float32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // self.group_size, self.group_size).float() - 8.0
        w = q * self.scale[..., None] + self.zero[..., None]
        return w.reshape(n, k)

    def packed(self) -> torch.Tensor:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes.to(torch.int32), 1)

    def scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's [K // group, N, 2] table."""
        return torch.stack([self.scale.t(), self.zero.t()], dim=-1).to(dtype).contiguous()

    def permute_rows(self, order: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.codes[order], self.scale[order], self.zero[order], self.group_size)


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """Codes q [N, K] (int8) with one scale per output row [N] (float32)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale[:, None]

    def permute_rows(self, order: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.codes[order], self.scale[order])


# Rows quantized at once: the fp32 temporaries of a chunk stay small (~4M values, 16 MB
# each) whatever the weight, so quantizing a 49152 x 2048 head at load does not add
# gigabytes to the peak (docs/memory.md). Every row is quantized on its own, so chunks
# change nothing in the result.
CHUNK_VALUES = 1 << 22


def _row_chunks(weight: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """(where in the output, rows) for each chunk of the weight's rows."""
    step = max(1, CHUNK_VALUES // max(1, weight.shape[1]))
    return [(slice(i, i + step), weight[i:i + step].detach())
            for i in range(0, weight.shape[0], step)]


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric min/max groupwise 4-bit: each group's range maps onto the 16 codes."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}")
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    codes = torch.empty(n, k, dtype=torch.int32)
    scale = torch.empty(n, k // group_size)
    zero = torch.empty(n, k // group_size)
    for rows, chunk in _row_chunks(weight):
        w = chunk.float().reshape(chunk.shape[0], k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        s = ((hi - lo) / 15.0).clamp(min=1e-8)  # a constant group still gets a usable scale
        q = ((w - lo[..., None]) / s[..., None]).round().clamp(0, 15)
        codes[rows] = q.reshape(chunk.shape[0], k)
        scale[rows], zero[rows] = s, lo + 8.0 * s
    return Int4Weight(codes.to(weight.device), scale.to(weight.device), zero.to(weight.device),
                      group_size)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row 8-bit: scale = max |w| / 127, so zero stays exactly zero."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n)
    for rows, chunk in _row_chunks(weight):
        w = chunk.float()
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        codes[rows] = (w / s[:, None]).round().clamp(-127, 127)
        scale[rows] = s
    return Int8Weight(codes.to(weight.device), scale.to(weight.device))
