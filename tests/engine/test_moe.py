"""MoE experts grouped by expert (engine/layers/moe.py): bit for bit transformers' eager loop in
float32, selected at load for a Qwen3-MoE model, and int8/int4 experts against their own
dequantized weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from engine.layers import moe
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.layers.quantization.quant import quantize_model
from scheduler.sampling_params import SamplingParams
from tests.engine.test_golden import assert_all_free, hf_greedy, make_engine, run
from tests.support.models import build_checkpoint, loaded_runner, tiny_config


def tiny_moe_model(experts: int = 8, top_k: int = 2, hidden: int = 64,
                   intermediate: int = 32) -> Any:
    """A random two-layer Qwen3-MoE in memory, its experts running transformers' eager loop."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": hidden, "intermediate_size": 64,
        "moe_intermediate_size": intermediate, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": experts, "num_experts_per_tok": top_k,
        "experts_implementation": "eager"}
    config = Qwen3MoeConfig(**shape)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def experts_of(model: Any) -> list[Any]:
    return [layer.mlp.experts for layer in model.model.layers]


def routing(rows: int, experts: int, top_k: int, allowed: int | None = None,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing [rows, top_k]; only the first `allowed` experts if given (the
    others then get no token)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=gen)
    if allowed is not None:
        logits[:, allowed:] = -torch.inf
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize(("rows", "experts", "top_k", "allowed"), [
    (1, 8, 2, None),  # one token: 6 of 8 experts idle
    (5, 8, 2, 3),  # only 3 experts hit, the other 5 get no token
    (16, 8, 2, None),
    (64, 16, 4, None),  # four experts a token: the fold's order decides the bits
])
def test_grouped_forward_equals_the_eager_loop_bit_for_bit(rows: int, experts: int, top_k: int,
                                                           allowed: int | None) -> None:
    model = tiny_moe_model(experts, top_k)
    module = experts_of(model)[0]
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    index, weights = routing(rows, experts, top_k, allowed)
    with torch.inference_mode():
        want = module(x, index, weights)  # transformers' loop
        assert moe.use_grouped_experts(model) == 2
        got = module(x, index, weights)  # dispatched to ours now
    assert model.config._experts_implementation == moe.IMPL_NAME
    assert torch.equal(got, want)


def test_the_fold_adds_in_expert_order() -> None:
    """A token's weighted outputs are summed first + second + ... by expert id (the eager loop's
    order), not by top-k slot: float32 sums that round differently tell the two apart."""
    index = torch.tensor([[3, 0, 2], [1, 2, 0]])  # [T=2, K=3]
    groups = moe.group_by_expert(index, torch.ones(2, 3), 4)
    assert groups.counts == [2, 1, 2, 1]
    # sorted pairs: (t0, e0), (t1, e0), (t1, e1), (t1, e2), (t0, e2), (t0, e3)
    assert groups.tokens.tolist() == [0, 1, 1, 1, 0, 0]
    weighted = torch.tensor([[3.0], [1e8], [3.0], [3.0], [3.0], [1e8]])
    out = moe.fold(weighted, groups.fold_rows, 3).flatten().tolist()
    # token 0: (3 + 3) + 1e8 = 1e8 + 8 in float32 (by slot: (1e8 + 3) + 3 = 1e8);
    # token 1: (1e8 + 3) + 3 = 1e8 (by slot: (3 + 3) + 1e8 = 1e8 + 8)
    assert out == [1e8 + 8, 1e8]


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


def test_the_served_tiny_moe_runs_grouped_and_gives_the_eager_loops_tokens(
        tiny_qwen3_moe: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = loaded_runner(tiny_config(tiny_qwen3_moe))
    assert runner.model.config._experts_implementation == moe.IMPL_NAME
    layers = [m for m in runner.model.modules() if hasattr(m, moe.LINEARS)]
    assert len(layers) == 2  # both layers' experts, each dispatching to ours
    assert all(ALL_EXPERTS_FUNCTIONS[m.config._experts_implementation]
               is moe.grouped_experts_forward for m in layers)
    assert all(hasattr(m, "gate_up_proj") for m in layers)  # float32: the stack is kept
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32,
                                              experts_implementation="eager").eval()
    gen = torch.Generator().manual_seed(5)
    prompts = {f"m{i}": torch.randint(3, runner.vocab_size, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(3, 30, (5,), generator=gen))}
    want = {rid: hf_greedy(hf, ids, 10) for rid, ids in prompts.items()}
    engine = make_engine(runner, max_num_batched_tokens=256)
    assert run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=10)) == want
    assert_all_free(engine)


def kernel_weight(module: nn.Module) -> torch.Tensor:
    """The weight a quantized module's kernel really uses: its output for the identity (the
    kernel's, not the dense copy's that calls of more than dense_above rows would take)."""
    assert isinstance(module, Int4Linear | Int8Linear)
    return module._kernel(torch.eye(module.in_features, dtype=module.kernel_dtype)).float().t()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_weights(mode: str) -> None:
    """Every expert's matrices become the mode's kernels (the stack is freed), and the grouped
    forward gives the eager loop's output on the weights those kernels use. Steps of up to
    DENSE_ABOVE_ROWS rows an expert: at most 8 rows in all."""
    model = tiny_moe_model()
    reference = copy.deepcopy(experts_of(model)[0])
    moe.use_grouped_experts(model)
    quantize_model(model, mode, None)
    assert moe.drop_stacked_weights(model) == 2
    module = experts_of(model)[0]
    linears: moe.ExpertLinears = getattr(module, moe.LINEARS)
    kind = Int8Linear if mode == "int8" else Int4Linear
    assert all(isinstance(m, kind) for m in (*linears.gate_up, *linears.down))
    assert not hasattr(module, "gate_up_proj")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    index, weights = routing(8, 8, 2, seed=1)
    with torch.inference_mode(), torch.no_grad():
        reference.gate_up_proj.copy_(torch.stack([kernel_weight(m) for m in linears.gate_up]))
        reference.down_proj.copy_(torch.stack([kernel_weight(m) for m in linears.down]))
        want = reference(x, index, weights)
        got = module(x, index, weights)
    # the kernels compute in bf16: a few bf16 steps of rounding, not the quantization's error
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
