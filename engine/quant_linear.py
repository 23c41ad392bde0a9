"""Drop-in replacements for nn.Linear that hold weight-only quantized weights.

Which kernel is fastest depends on how many token rows the step carries: a quantized
kernel reads 4-8x fewer weight bytes, which wins while the step is bound by reading the
weights (decode at a few streams), but its unpacking costs more per row than a dense GEMM,
which wins from a few rows up (measurements in docs/quantization.md). So a module may keep
a dense copy of its weight and use it for calls with more than `dense_above` rows. The
check is on a static shape, so torch.compile turns it into a guard, not a graph break.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.quant_pack import Int4Weight, Int8Weight

# bfloat16: the CPU kernels' fast path (their float32-activation path is 10-20x slower here).
KERNEL_DTYPE = torch.bfloat16


class _QuantLinear(nn.Module):
    """Shared shape handling: [..., K] -> [rows, K] -> kernel -> [..., N], plus the dense path."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dense: torch.Tensor | None, dense_above: int, kernel_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dense_above = dense_above
        self.kernel_dtype = kernel_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The dense path is an nn.Linear of its own (engine/packed_linear.py may swap it for
        # a packed one), sharing the bias and, with tied embeddings, the embedding's table.
        self.dense = None if dense is None else _dense_linear(dense, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        if self.dense is not None and rows > self.dense_above:
            return self.dense(x)
        out = self._kernel(x.reshape(rows, self.in_features).to(self.kernel_dtype))
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        dense = f", dense above {self.dense_above} rows" if self.dense is not None else ""
        return f"in={self.in_features}, out={self.out_features}{dense}"


def _dense_linear(weight: torch.Tensor, bias: nn.Parameter | None) -> nn.Linear:
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=False, device="meta", dtype=weight.dtype)
    # A Parameter, not a copy: a tied weight (the embedding) stays one shared tensor.
    linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
        weight.detach(), requires_grad=False)
    linear.register_parameter("bias", bias)
    return linear


class Int4Linear(_QuantLinear):
    """int4 groupwise codes packed for `aten._weight_int4pack_mm_for_cpu`."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int = 0,
                 kernel_dtype: torch.dtype = KERNEL_DTYPE) -> None:
        n, k = weight.codes.shape
        super().__init__(k, n, bias, dense, dense_above, kernel_dtype)
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed())
        self.register_buffer("scales_and_zeros", weight.scales_and_zeros(kernel_dtype))

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size,
                                                           self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"int4 g{self.group_size}, " + super().extra_repr()


class Int8Linear(_QuantLinear):
    """int8 codes with a scale per output row for `aten._weight_int8pack_mm`."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int = 0,
                 kernel_dtype: torch.dtype = KERNEL_DTYPE) -> None:
        n, k = weight.codes.shape
        super().__init__(k, n, bias, dense, dense_above, kernel_dtype)
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scale.to(kernel_dtype))

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.codes, self.scales)

    def extra_repr(self) -> str:
        return "int8 per-row, " + super().extra_repr()
