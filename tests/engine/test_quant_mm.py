"""The many-row quantized matmuls (engine/layers/quantization/csrc/quant_mm.cpp): they read torch's own
int4/int8 CPU layouts bit for bit, compute what the dequantized weights give, do not let one
row's result depend on the others, and the quantized modules pick them above
MANY_ROWS_ABOVE rows (torch.compile included)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quantization import many_rows
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.layers.quantization.pack import Int4Weight, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not many_rows.available(),
                                reason="no compiler or no bf16 micro-kernel on this CPU")

BF16 = torch.bfloat16


def int4_weight(n: int, k: int, group: int, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group)


def expected_bf16_weight(q: Int4Weight) -> torch.Tensor:
    """(q - 8) * scale + zero in fp32 with one rounding (a fused multiply-add), from the
    bf16 scales and zeros torch's kernel reads, then rounded to bf16."""
    table = q.scales_and_zeros(BF16).float()  # [K / group, N, 2]
    scale = table[..., 0].t().repeat_interleave(q.group_size, 1)
    zero = table[..., 1].t().repeat_interleave(q.group_size, 1)
    exact = (q.codes.double() - 8) * scale.double() + zero.double()
    return exact.float().to(BF16)


# N: whole 64-row blocks, the 16/32/48-row tails of torch's layout, and both together.
@pytest.mark.parametrize(("n", "k", "group"), [(128, 64, 32), (48, 64, 32), (112, 96, 32),
                                               (576, 256, 64), (80, 256, 128)])
def test_int4_reads_torchs_layout_bit_for_bit(n: int, k: int, group: int) -> None:
    """Multiplying the identity gives each weight alone: the dequantized weight, exactly."""
    q = int4_weight(n, k, group, seed=n + k)
    got = many_rows.int4_mm(torch.eye(k, dtype=BF16), q.packed(), group, q.scales_and_zeros(BF16))
    assert torch.equal(got.t(), expected_bf16_weight(q))


@pytest.mark.parametrize("m", [9, 32, 33, 70])
def test_int4_equals_the_dequantized_matmul_and_torchs_kernel(m: int) -> None:
    q = int4_weight(320, 512, 32, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(BF16)
    got = many_rows.int4_mm(x, q.packed(), 32, q.scales_and_zeros(BF16)).float()
    reference = x.float() @ expected_bf16_weight(q).float().t()  # fp32 sums, as the kernel
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-3)
    # torch's kernel keeps the dequantized weights in fp32, ours rounds them to bf16 first:
    # the two differ by that rounding (~0.3% of a weight), so they agree to ~1% overall.
    torch_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.packed(), 32,
                                                              q.scales_and_zeros(BF16)).float()
    assert (got - torch_kernel).norm() / torch_kernel.norm() < 1e-2


@pytest.mark.parametrize(("n", "k", "m"), [(96, 128, 12), (64, 36, 40), (200, 520, 33)])
def test_int8_equals_codes_times_scales(n: int, k: int, m: int) -> None:
    """int8 codes are exact in bf16; the scale multiplies each fp32 sum before its rounding.
    Shapes with N % 16 and K % 4 left over take the scalar tail."""
    gen = torch.Generator().manual_seed(n)
    q = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(BF16)
    scales = q.scale.to(BF16)
    got = many_rows.int8_mm(x, q.codes, scales).float()
    reference = (x.float() @ q.codes.float().t()) * scales.float()
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-3)
    identity = many_rows.int8_mm(torch.eye(k, dtype=BF16), q.codes, torch.ones(n, dtype=BF16))
    assert torch.equal(identity.t(), q.codes.to(BF16))


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Each output is one dot product over K in a fixed order, whatever the batch: a row gives
    the same bits alone among 9 rows as among 70 (in another 32-row block)."""
    q = int4_weight(256, 512, 32, seed=3)
    q8 = quantize_int8(torch.randn(256, 512, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(5)).to(BF16)
    packed, table = q.packed(), q.scales_and_zeros(BF16)
    wide = many_rows.int4_mm(x, packed, 32, table)
    assert torch.equal(many_rows.int4_mm(x[:9].contiguous(), packed, 32, table), wide[:9])
    assert torch.equal(many_rows.int4_mm(x[40:49].contiguous(), packed, 32, table), wide[40:49])
    wide8 = many_rows.int8_mm(x, q8.codes, q8.scale.to(BF16))
    assert torch.equal(many_rows.int8_mm(x[45:60].contiguous(), q8.codes, q8.scale.to(BF16)),
                       wide8[45:60])


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_modules_take_the_many_row_kernel_above_the_threshold(cls: str) -> None:
    torch.manual_seed(6)
    w = torch.randn(64, 64) * 0.1
    module = Int4Linear(quantize_int4(w, 32)) if cls == "int4" else Int8Linear(quantize_int8(w))
    assert module.use_many_rows
    at, above = many_rows.MANY_ROWS_ABOVE, many_rows.MANY_ROWS_ABOVE + 1
    with torch.inference_mode():
        for rows, kernel in ((at, module._kernel), (above, module._many_rows_kernel)):
            x = torch.randn(rows, 64, dtype=BF16)
            assert torch.equal(module(x), kernel(x))


def test_the_compiled_step_traces_the_many_row_kernel() -> None:
    """torch.compile traces the kernel through its registered fake (shapes only): the
    compiled module gives the eager module's bits at 1 and at 16 rows."""
    torch.manual_seed(7)
    module = Int4Linear(quantize_int4(torch.randn(128, 64) * 0.1, 32))
    compiled = torch.compile(module, backend="aot_eager", dynamic=False)
    with torch.inference_mode():
        for rows in (1, 16):
            x = torch.randn(rows, 64, dtype=BF16)
            assert torch.equal(compiled(x), module(x))


def test_shapes_it_cannot_take_are_refused_with_an_error() -> None:
    """An empty weight or an odd K (the micro-kernel reads bf16 pairs) is a RuntimeError
    naming the op, not a crash of the process (an empty weight divided by zero once)."""
    x = torch.randn(12, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="int8_mm: the weight must have rows"):
        many_rows.int8_mm(x, torch.zeros(0, 64, dtype=torch.int8), torch.ones(0, dtype=BF16))
    odd = torch.randn(12, 33, dtype=BF16)
    with pytest.raises(RuntimeError, match="int8_mm: the weight must have rows"):
        many_rows.int8_mm(odd, torch.ones(16, 33, dtype=torch.int8), torch.ones(16, dtype=BF16))


def test_a_linear_of_odd_width_stays_dense() -> None:
    """torch's int8 kernel crashes the process on an odd K, ours refuses it: such a linear
    is left dense by quantize_model, in both modes."""
    from torch import nn

    from engine.layers.quantization.quant import quantize_model

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 33)
            self.proj = nn.Linear(33, 16)

        def get_output_embeddings(self) -> nn.Module:
            return self.proj

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

    for mode in ("int8", "int4"):
        model = Tiny()
        assert quantize_model(model, mode, None) == 0
        assert type(model.proj) is nn.Linear
