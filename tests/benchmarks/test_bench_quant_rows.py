"""bench_quant_rows: the crossover rule and the timing loop on a tiny quantized module."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_quant_rows import crossover, measure
from engine.layers.quantization.linear import Int8Linear
from engine.layers.quantization.pack import quantize_int8


def test_crossover_is_the_first_row_count_from_which_dense_always_wins() -> None:
    ms = {1: {"kernel": 1.0, "dense": 2.0}, 8: {"kernel": 2.0, "dense": 1.0},
          16: {"kernel": 2.0, "dense": 3.0}, 32: {"kernel": 4.0, "dense": 3.0},
          64: {"kernel": 8.0, "dense": 5.0}}
    assert crossover(ms) == 32  # 8 wins for dense but 16 does not: not a crossover yet
    assert crossover({1: {"kernel": 1.0, "dense": 2.0}}) is None


def test_measure_times_both_paths_of_every_module_at_every_row_count() -> None:
    w = torch.randn(32, 64)
    mod = Int8Linear(quantize_int8(w), dense=w, dense_above=8)
    out = measure([("model.layers.0.mlp.up_proj", mod), ("model.layers.1.mlp.up_proj", mod),
                   ("lm_head", mod)], (1, 4), repeats=2, seed=0)
    assert set(out) == {1, 4}
    for v in out.values():
        assert set(v) == {"all", "mlp.up_proj", "lm_head"}
        assert all(t["kernel"] > 0 and t["dense"] > 0 for t in v.values())
        for path in ("kernel", "dense"):  # the groups partition the modules
            assert v["all"][path] == pytest.approx(v["mlp.up_proj"][path] + v["lm_head"][path])
