"""bench_fused_linears: the one command runs end to end on small shapes and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.bench_fused_linears import build, main
from engine.layers.packed_linear import packing_applies


@pytest.mark.skipif(not packing_applies(torch.device("cpu"), torch.bfloat16, False),
                    reason="this CPU's oneDNN has no bf16 path")
def test_one_run_writes_every_kind_group_and_row_count(tmp_path: Path) -> None:
    main(["--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1",
          "--head-dim", "64", "--repeats", "2", "--iters", "2", "--out", str(tmp_path)])
    [out] = tmp_path.glob("fused-linears-*.json")
    data = json.loads(out.read_text())
    assert data["machine"] and data["threads"] >= 1
    rows = {(r["kind"], r["group"], r["rows"]) for r in data["results"]}
    assert rows == {(k, g, n) for k, ns in (("int4", (1, 2, 4, 8)), ("bf16", (16, 64, 256)))
                    for n in ns for g in ("qkv", "gate_up")}
    assert all(r["apart_us"] > 0 and r["fused_us"] > 0 for r in data["results"])


@torch.inference_mode()
def test_the_fused_module_computes_the_parts() -> None:
    parts, fused = build("int4", 64, [128, 64, 64])
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
