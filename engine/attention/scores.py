"""How a layer shapes its attention scores before the softmax, beyond causality: a sliding
window, Gemma 2's soft cap, gpt-oss's sinks (ScoreRule), and the two score operations the
torch paths share. The C++ kernel has its own ScoreRule (csrc/paged_decode.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class ScoreRule:
    """How one layer shapes its attention scores before the softmax, beyond causality. Every
    path applies it: the torch decode groups and prefill chunks, the C++ kernel (its own
    ScoreRule), the batch-invariant tiles, eager or compiled."""

    # The query sees only its last `window` positions (0: all): Mistral's sliding window,
    # the local layers of Gemma 2/3 and gpt-oss.
    window: int = 0
    # Gemma 2: scores become softcap * tanh(score / softcap) (0: unchanged). SDPA has no such
    # option, nor sinks: a chunk's prefill then computes its scores itself (explicit_attention).
    softcap: float = 0.0
    # gpt-oss: per query head, one more logit in the softmax's sum that attends to nothing
    # ([H] float32; None: none).
    sink: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Nothing beyond a causal softmax: SDPA computes it."""
        return not self.softcap and self.sink is None


FULL = ScoreRule()


def cap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's soft cap on attention scores: softcap * tanh(score / softcap)."""
    return torch.tanh(scores / softcap) * softcap


def softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with a sink (broadcast to scores[..., :1]), the sum also
    holds exp(sink): the weights then add up to less than 1 (gpt-oss)."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    sinks = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
