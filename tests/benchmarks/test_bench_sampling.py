"""bench_sampling: the ratios and the table from hand-made samples, and one small run end to end
(the current tree against itself) that writes its JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_sampling import ROOT, VARIANTS, main, summarize, table


def test_ratios_against_greedy_and_against_a_whole_step() -> None:
    ms = {"greedy": 2.0, "top_p": 6.0, "penalties": 4.0}
    samples = {f"{code}/{v}/64": [[0.5, t - 0.5]] * 3 for code in ("before", "after")
               for v, t in ms.items()}
    results = summarize(samples, {64: [100.0, 102.0, 98.0]})
    top_p = next(r for r in results if (r["code"], r["variant"]) == ("after", "top_p"))
    assert top_p["total_ms"] == 6.0 and top_p["sampler_vs_greedy"] == 3.0
    # the measured step (100 ms) with its 2 ms of greedy sampling swapped for 6 ms
    assert top_p["step_vs_greedy_step"] == pytest.approx(1.04)
    assert top_p["sampler_share_of_step"] == pytest.approx(6 / 104)
    assert table(results).count("\n") == 1 + len(VARIANTS)  # header, rule, a row each


@pytest.mark.slow
def test_one_small_run_writes_its_results(tmp_path: Path) -> None:
    # Eager, and logits over 64 positions: the compile and a bf16 forward over 2048 tokens
    # took 150 of this test's 170 s on a CPU without bf16 hardware.
    main(["--before", str(ROOT), "--rows", "2,4", "--rounds", "1", "--steps", "1",
          "--logit-rows", "64", "--enforce-eager", "--out", str(tmp_path)])
    [out] = tmp_path.glob("sampling-*.json")
    data = json.loads(out.read_text())
    assert data["machine"] and data["logits"]["nucleus_size_quantiles"]
    assert data["logits"]["rows"] == 64 and data["args"]["enforce_eager"]
    assert {(r["code"], r["variant"], r["rows"]) for r in data["results"]} == {
        (c, v, n) for c in ("before", "after") for v in VARIANTS for n in (2, 4)}
    assert out.with_suffix(".png").exists()


def test_too_few_logit_rows_for_the_rows_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--rows", "16,64", "--logit-rows", "64"])
