"""Mixture-of-experts on the CPU: the (token, expert) pairs grouped by expert, one matmul each.

Why. transformers stores a Qwen3-MoE layer's experts as two stacked weights (gate_up_proj
[E, 2I, H], down_proj [E, H, I]) and its eager forward loops over the experts hit, paying
about ten small ops per expert (a one-hot mask, `where`, gathers, an `index_add_`) around
two `F.linear`s on a slice of the stack, and in bf16 each such `F.linear` reorders its weight
into oneDNN's layout on every call. Here the pairs are sorted by expert once; each active
expert runs its two matmuls on one contiguous slice of rows; the outputs are weighted and
folded back per token. The experts' weights are split at load into one linear per expert and
matrix, so the loader's other passes reach them like any linear: `--quantization int8/int4`
quantizes each expert's matrices (engine/layers/quantization/quant.py), and bf16 packs them
for oneDNN once (engine/layers/packed_linear.py). Numbers: docs/models.md, benchmarks/bench_moe.py.

Exact. In float32 the output equals the eager loop's bit for bit (tests/engine/test_moe.py):
each expert's matmul sees the same rows in the same order (the loop takes them by top-k slot,
then token: pairs are numbered that way and sorted stably), the gate and the routing weight
are the same element-wise ops, and each token's contributions are added in ascending expert
order starting from the first one, as the loop's `index_add_` into zeros does them.

How it plugs in. `use_grouped_experts` registers `grouped_experts_forward` in transformers'
ExpertsInterface as IMPL_NAME and selects it with `set_experts_implementation`, for models
whose experts module has the stacked gated layout this reads. transformers' loop stays
registered ("eager"): a float32 model keeps its stacked weights (the linears are views of
them), so it can switch back; once the per-expert linears own their weights (packed or
quantized), `drop_stacked_weights` frees the stack and only this forward can run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

IMPL_NAME = "pagedserve"
LINEARS = "linears"  # the attribute of an experts module that holds its ExpertLinears


class ExpertLinears(nn.Module):
    """One experts module's weights as a linear per expert and matrix. Built as views of the
    stacked weights (no copy), so later passes can swap each for a packed or quantized one."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(_view_linear(w) for w in gate_up)  # [2I, H] each
        self.down = nn.ModuleList(_view_linear(w) for w in down)  # [H, I] each


def _view_linear(weight: torch.Tensor) -> nn.Linear:
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)  # a view, shared
    return linear


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A step's S = T * K (token, expert) pairs, sorted by expert. Pair p = k * T + t, where k
    is the top-k slot: stable-sorted, an expert's rows come in the eager loop's order."""

    tokens: torch.Tensor  # [S] the token of each sorted pair
    weights: torch.Tensor  # [S, 1] its routing weight
    fold_rows: torch.Tensor  # [S] its row in the [K * T] fold buffer: rank * T + token
    counts: list[int]  # [E] pairs per expert, in expert order


def group_by_expert(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    num_experts: int) -> ExpertGroups:
    """top_k_index/top_k_weights [T, K] (K distinct experts per token) -> the sorted pairs."""
    t, k = top_k_index.shape
    pairs = top_k_index.t().reshape(-1)  # [S], slot-major: the eager loop's row order
    order = torch.argsort(pairs, stable=True)  # [S]
    counts = torch.bincount(pairs, minlength=num_experts).tolist()  # the one host sync
    # A pair's rank among its token's experts, ascending: where the fold adds it.
    rank = (top_k_index[:, None, :] < top_k_index[:, :, None]).sum(-1)  # [T, K]
    token_of_pair = torch.arange(t, device=pairs.device).repeat(k)  # [S]
    fold_rows = rank.t().reshape(-1) * t + token_of_pair  # [S]
    return ExpertGroups(tokens=token_of_pair[order],
                        weights=top_k_weights.t().reshape(-1)[order, None],
                        fold_rows=fold_rows[order], counts=counts)


@torch.compiler.disable  # data-dependent loop: one graph break, never a recompile per routing
def grouped_experts_forward(self: Any, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature (self: the experts module, its `_apply_gate` HF's
    gating): hidden [T, H], top_k_index/weights [T, K] -> [T, H]."""
    linears: ExpertLinears = getattr(self, LINEARS)
    groups = group_by_expert(top_k_index, top_k_weights, len(linears.gate_up))
    rows = hidden_states[groups.tokens]  # [S, H], grouped by expert
    outs, start = [], 0
    for expert, n in enumerate(groups.counts):
        if n:
            h = linears.gate_up[expert](rows[start:start + n])  # [n, 2I]
            outs.append(linears.down[expert](self._apply_gate(h)))  # [n, H]
            start += n
    weighted = torch.cat(outs) * groups.weights  # [S, H]
    return fold(weighted, groups.fold_rows, top_k_index.shape[1]).to(hidden_states.dtype)


def fold(weighted: torch.Tensor, fold_rows: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's K weighted outputs [S, H] summed in ascending expert order -> [T, H]:
    the eager loop's `index_add_` order (first + second + ...), so float32 keeps its bits."""
    buffer = torch.empty_like(weighted).index_copy_(0, fold_rows, weighted)  # [K * T, H]
    parts = buffer.chunk(k)  # [T, H] each: every token's r-th expert
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


# ----------------------------------------------------------------------------- selection


def supports(module: Any) -> bool:
    """An experts module of transformers' interface (`use_experts_implementation`) in the
    stacked gated layout this forward reads: gate_up_proj [E, 2I, H], down_proj [E, H, I],
    no bias, no post-expert norm."""
    flags = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
    if not all(hasattr(module, f) for f in flags) or not hasattr(module, "_apply_gate"):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    return bool(module.has_gate and not module.has_bias and not module.is_transposed
            and not module.has_post_expert_norm and gate_up.dim() == down.dim() == 3
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == down.shape[1]
            and gate_up.shape[1] == 2 * down.shape[2])


def register() -> None:
    """Make IMPL_NAME a valid experts implementation (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPL_NAME, grouped_experts_forward)


def use_grouped_experts(model: Any) -> int:
    """Split every supported experts module's weights into ExpertLinears and select this
    forward for the model. -> experts modules prepared (0: not an MoE we run, left alone)."""
    experts = [m for m in model.modules() if supports(m)]
    if not experts:
        return 0
    register()
    for module in experts:
        setattr(module, LINEARS, ExpertLinears(module.gate_up_proj, module.down_proj))
    model.set_experts_implementation(IMPL_NAME)
    if any(m.config._experts_implementation != IMPL_NAME for m in experts):
        raise RuntimeError("experts implementation not selected on every MoE layer")
    log.info("MoE: %d experts layers grouped by expert (%s)", len(experts), IMPL_NAME)
    return len(experts)


def drop_stacked_weights(model: Any) -> int:
    """Free the stacked expert weights of every module whose per-expert linears no longer view
    them (packed or quantized at load): they would double the experts' memory. -> dropped."""
    dropped = 0
    for module in model.modules():
        linears = getattr(module, LINEARS, None)
        if not isinstance(linears, ExpertLinears) or not hasattr(module, "gate_up_proj"):
            continue
        if any(isinstance(m, nn.Linear) for m in (*linears.gate_up, *linears.down)):
            continue  # still views of the stack (float32, unquantized): it costs nothing
        del module.gate_up_proj, module.down_proj
        dropped += 1
    return dropped
