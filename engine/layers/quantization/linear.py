"""Drop-in replacements for nn.Linear that hold weight-only quantized weights.

Which kernel is fastest depends on how many token rows the step carries. torch's kernels
read 4-8x fewer weight bytes than a dense GEMM, which wins while the step is bound by reading
the weights (decode at a few streams), but they unpack the weights again for every few rows,
so from ~8 rows up a call goes to our many-row kernel (many_rows.py), which dequantizes each
weight tile once for all the rows and runs about as fast as a dense GEMM there. Where that
kernel is unavailable a module may keep a dense copy of its weight instead and use it for
calls with more than `dense_above` rows (measurements in docs/memory.md). The checks are on
a static shape, so torch.compile turns them into guards, not graph breaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from engine.cpu_flags import cpu_flags
from engine.layers.quantization import many_rows
from engine.layers.quantization.pack import Int4Weight, Int8Weight

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
        # our many-row kernel computes in bf16 on the CPU (the modules are built on the CPU)
        self.use_many_rows = kernel_dtype == torch.bfloat16 and many_rows.available()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The dense path is an nn.Linear of its own (engine/layers/packed_linear.py may swap it for
        # a packed one), sharing the bias and, with tied embeddings, the embedding's table.
        self.dense = None if dense is None else _dense_linear(dense, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        if self.dense is not None and rows > self.dense_above:
            return self.dense(x)
        x2d = x.reshape(rows, self.in_features).to(self.kernel_dtype)
        if self.use_many_rows and rows > many_rows.MANY_ROWS_ABOVE:
            out = self._many_rows_kernel(x2d.contiguous())
        else:
            out = self._kernel(x2d)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        """torch's kernel (any row count)."""
        raise NotImplementedError

    def _many_rows_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        """Ours, for calls of more than MANY_ROWS_ABOVE rows (only when self.use_many_rows)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        dense = f", dense above {self.dense_above} rows" if self.dense is not None else ""
        return f"in={self.in_features}, out={self.out_features}{dense}"

    def _concat_base(self, parts: Sequence[_QuantLinear]) -> bool:
        """Set up self (made by cls.__new__) as the parts concatenated along their outputs,
        everything but the kernel's own buffers. False if the parts differ in kind."""
        first = parts[0]
        if len({(p.in_features, p.dense_above, p.kernel_dtype, p.dense is None,
                 p.bias is None) for p in parts}) != 1:
            return False
        dense = None
        if first.dense is not None:
            dense = torch.cat([p.dense.weight for p in parts if p.dense is not None])
        bias = None if first.bias is None else torch.cat([p.bias for p in parts
                                                            if p.bias is not None])
        _QuantLinear.__init__(self, first.in_features, sum(p.out_features for p in parts), bias,
                              dense, first.dense_above, first.kernel_dtype)
        return True


def concat_dense(weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None]) -> nn.Linear:
    """nn.Linears' weights (and biases, all or none) concatenated along the outputs."""
    bias = None if biases[0] is None else nn.Parameter(
        torch.cat([b for b in biases if b is not None]).detach(), requires_grad=False)
    return _dense_linear(torch.cat([w.detach() for w in weights]), bias)


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

    packed: torch.Tensor  # buffers
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int = 0,
                 kernel_dtype: torch.dtype = KERNEL_DTYPE) -> None:
        n, k = weight.codes.shape
        super().__init__(k, n, bias, dense, dense_above, kernel_dtype)
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed())
        self.register_buffer("scales_and_zeros", weight.scales_and_zeros(kernel_dtype))

    @classmethod
    def concat(cls, parts: Sequence[Int4Linear]) -> Int4Linear | None:
        """One module whose output is the parts' outputs side by side; None if they differ in
        kind, or if the kernel's packed layout does not concatenate (it is blocked along the
        outputs, 64 rows to a block in torch 2.13: parts of 32 rows do not line up), which a
        probe through the kernel checks bit for bit."""
        fused = cls.__new__(cls)
        if len({p.group_size for p in parts}) != 1 or not fused._concat_base(parts):
            return None
        fused.group_size = parts[0].group_size
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))
        fused.register_buffer("scales_and_zeros",
                              torch.cat([p.scales_and_zeros for p in parts], dim=1))
        return fused if _same_kernel_outputs(fused, parts) else None

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size,
                                                           self.scales_and_zeros)

    def _many_rows_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return many_rows.int4_mm(x2d, self.packed, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"int4 g{self.group_size}, " + super().extra_repr()


class Int8Linear(_QuantLinear):
    """int8 codes with a scale per output row for `aten._weight_int8pack_mm`."""

    codes: torch.Tensor  # buffers
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int = 0,
                 kernel_dtype: torch.dtype = KERNEL_DTYPE) -> None:
        n, k = weight.codes.shape
        super().__init__(k, n, bias, dense, dense_above, kernel_dtype)
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scale.to(kernel_dtype))

    @classmethod
    def concat(cls, parts: Sequence[Int8Linear]) -> Int8Linear | None:
        """One module whose output is the parts' outputs side by side; None if they differ."""
        fused = cls.__new__(cls)
        if not fused._concat_base(parts):
            return None
        fused.register_buffer("codes", torch.cat([p.codes for p in parts]))
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))
        return fused if _same_kernel_outputs(fused, parts) else None

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.codes, self.scales)

    def _many_rows_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return many_rows.int8_mm(x2d, self.codes, self.scales)

    def extra_repr(self) -> str:
        return "int8 per-row, " + super().extra_repr()


class W8A8Linear(Int8Linear):
    """`--quantization w8a8`: Int8Linear's codes and scales, and for calls of more than
    W8A8_ABOVE token rows the activations in int8 too: each row gets its own scale (dynamic,
    symmetric: amax / 127), and the product is an int8 GEMM with int32 sums (torch._int_mm,
    oneDNN's VNNI/AMX int8 kernels on the CPU; the same sums from float32 GEMMs on a CPU
    without int8 dot products, see int_mm_by_float), scaled back by both scales. A step of
    many rows is bound by arithmetic, and int8 products run at twice bf16's rate. At or below W8A8_ABOVE
    rows a step is bound by reading the weights, which int8 activations do not change: those
    calls keep the weight-only kernel (Int8Linear's), one copy of the codes serving both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        if rows <= W8A8_ABOVE:
            return super().forward(x)
        out = w8a8_mm(x.reshape(rows, self.in_features), self.codes, self.scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"w8a8 above {W8A8_ABOVE} rows, " + super().extra_repr()


W8A8_ABOVE = 8  # token rows; see W8A8Linear and docs/quantization.md


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 codes [M, K] and a float32 scale per row [M, 1] (amax / 127; a zero
    row gets codes 0)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 127.0
    codes = torch.round(xf / scale.clamp(min=1e-30)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def w8a8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int8 codes [N, K] with a scale per row [N] -> [M, N] float32: x
    quantized per row, int32 sums (exact: K * 127^2 < 2^31 up to K = 133,000), both scales
    applied once."""
    xq, x_scale = quantize_rows(x)
    if xq.device.type == "cpu" and not CPU_INT8_DOT:
        sums = int_mm_by_float(xq, codes)
    else:
        sums = torch._int_mm(xq, codes.t())
    return sums.float() * x_scale * scales.float()


def cpu_has_int8_dot(cpuinfo: str | None = None) -> bool:
    """False only for an x86 CPU without int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI
    or AMX int8). There oneDNN's int8 GEMM behind torch._int_mm is ~11x slower than an fp32
    GEMM of the same shape (an AVX2-only EPYC, 2 threads: 23.3 ms against 2.1 for
    [64, 576] x [576, 1536]). Elsewhere (ARM's /proc/cpuinfo lists "Features", not "flags";
    no /proc) torch's own kernel is used. `cpuinfo`: /proc/cpuinfo's text (tests)."""
    flags = cpu_flags(cpuinfo)
    return flags is None or bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


CPU_INT8_DOT = cpu_has_int8_dot()  # read once: a constant to torch.compile, not a file read


# Every partial sum of int8 x int8 products over at most this many terms is an integer of at
# most 1024 * 128^2 = 2^24 in magnitude, which float32 holds exactly, in whatever order a GEMM
# adds. (oneDNN's reduced-precision fp32 modes, torch.set_float32_matmul_precision below
# "highest", keep it exact too: int8 values are exact in bf16 and tf32, and oneDNN
# accumulates in fp32.)
EXACT_FLOAT_K = 1024


def int_mm_by_float(xq: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(xq, codes.t())'s int32 sums, bit for bit, from float32 GEMMs: one per
    slice of EXACT_FLOAT_K columns (exact, above), each converted to int32 and added. For CPUs
    without int8 dot products, where this is the faster way to the same integers."""
    k = xq.shape[1]
    sums = None
    for start in range(0, k, EXACT_FLOAT_K):
        end = min(start + EXACT_FLOAT_K, k)
        part = (xq[:, start:end].float() @ codes[:, start:end].float().t()).to(torch.int32)
        sums = part if sums is None else sums.add_(part)
    assert sums is not None, "K must be positive"
    return sums


def _same_kernel_outputs(fused: _QuantLinear, parts: Sequence[_QuantLinear]) -> bool:
    """Whether the fused kernel gives every part's output bits, on a probe of two rows."""
    device = next(fused.buffers()).device
    gen = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn(2, fused.in_features, generator=gen, device=device).to(fused.kernel_dtype)
    with torch.inference_mode():
        return torch.equal(fused._kernel(probe), torch.cat([p._kernel(probe) for p in parts], -1))
