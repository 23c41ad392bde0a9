"""Perplexity of a causal LM over a fixed text: exp(mean next-token NLL) over non-overlapping
chunks (each chunk's first token has no context and is not scored)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

TEXT = Path(__file__).resolve().parent.parent / "data" / "opticks_queries.txt"


def text_ids(tokenizer: Any, path: Path = TEXT) -> torch.Tensor:
    return torch.tensor(tokenizer(path.read_text()).input_ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model: Any, ids: torch.Tensor, chunk: int = 512) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:start + chunk][None]
        if piece.shape[1] < 2:
            break
        logits = model(input_ids=piece).logits[0, :-1].float()
        targets = piece[0, 1:]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
    return math.exp(nll / count)
