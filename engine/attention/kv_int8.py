"""The int8 KV cache (`--kv-cache-dtype int8`): how a K or V row is stored in an int8 pool.

A pool of the model's dtype holds each (token, kv head)'s K and V as head_dim values. An int8
pool holds it as head_dim + 2 bytes: head_dim int8 codes, then the row's own scale as a
float16 (the layout of a GGUF Q8_0 block, one block per row):

    codes = round(x / scale), clamped to [-127, 127];  scale = float16(amax(|x|) / 127)

Values whose row scale is below float16's normal range (amax under ~7.8e-3) keep fewer bits,
and a row under ~3.8e-6 reads back as zeros, as in Q8_0; K and V rows are far larger.

One scale per token and head, computed when the token's K/V is written and never changed:
a block fills a token at a time, so a per-block scale would have to be fixed before its
values are known (or the block re-quantized as it grows). At head_dim 64 a row is 66 bytes
against 128 in bfloat16: the same --kv-cache-memory holds 1.94x the tokens (1.97x at 128).

Rounding is the same everywhere a row is written (here for the torch path, and the C++
kernel's fused step, csrc/paged_decode.cpp): the scale is rounded to float16 first and the
codes use that rounded scale, x * (1 / scale) in float32, rounded half to even; a test checks
both writers give the same bytes. Readers dequantize in float32 (code * scale).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # a float16 after each row's codes
CODE_MAX = 127  # symmetric: -128 is never used, so -x stores as -code(x)
# The largest float16: a row whose amax / 127 is above it (|x| over ~8.3e6) keeps this scale
# and saturates its codes at +-127, instead of an inf scale that would read back as NaN.
SCALE_MAX = 65504.0


def row_width(head_dim: int, int8: bool) -> int:
    """Elements of one (token, kv head) row in the pool."""
    return head_dim + SCALE_BYTES if int8 else head_dim


def is_int8(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def head_dim_of(pool: torch.Tensor) -> int:
    """The head dim of a pool (any of its views) whose last dimension is a row."""
    return pool.shape[-1] - SCALE_BYTES if is_int8(pool) else pool.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., hd] (any float dtype) -> int8 [..., hd + 2]: codes, then the scale's bytes."""
    xf = x.float()
    # float32(1 / 127) times amax, as the C++ writer computes it (it must give the same bytes)
    scale = (xf.abs().amax(-1, keepdim=True) * (1.0 / CODE_MAX)).clamp_(max=SCALE_MAX)
    scale = scale.to(torch.float16)
    s = scale.float()
    inverse = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = torch.round(xf * inverse).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., hd + 2] -> [..., hd] in `dtype` (computed in float32)."""
    hd = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., hd:].view(torch.float16).float()  # [..., 1]; a view: the row stride is even
    return (rows[..., :hd].float() * scale).to(dtype)
