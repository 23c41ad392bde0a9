"""The scheduler-cost benchmark on small N: the steady state it claims is the one it measures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
import benchmarks.bench_scheduler as bench
from benchmarks.bench_scheduler import bench_engine, bench_model, bench_scheduler

STAT_KEYS = {"median", "p90", "mean", "max"}


def assert_timings(result: dict[str, Any], names: list[str]) -> None:
    for name in names:
        stats = result[f"{name}_us"]
        assert set(stats) == STAT_KEYS, (name, stats)
        assert 0 < stats["median"] <= stats["p90"] <= stats["max"], (name, stats)


def test_decode_case_holds_n_running_sequences_and_never_preempts() -> None:
    r = bench_scheduler(num_running=12, steps=30, warmup=5)
    assert_timings(r, ["schedule", "postprocess", "total"])
    assert r["total_us"]["max"] >= max(r["schedule_us"]["max"], r["postprocess_us"]["max"])
    assert r["case"] == "decode" and r["steps"] == 30
    # Every measured step decoded exactly the 12 sequences, one token each, and none ended.
    assert r["scheduled_seqs"] == {"min": 12, "mean": 12, "max": 12}
    assert r["tokens_per_step"] == 12 and r["decode_only_steps"] == 30
    assert r["running_at_end"] == 12 and r["waiting_at_end"] == 0 and r["finished"] == 0
    assert r["num_preemptions"] == 0


def test_mixed_case_prefills_arrivals_beside_decodes() -> None:
    r = bench_scheduler(num_running=8, steps=300, warmup=0, mixed=True)
    assert_timings(r, ["schedule", "postprocess", "total"])
    assert r["num_preemptions"] == 0
    assert r["finished"] > 0  # outputs are 16-256 tokens: some ended and were replaced
    assert r["running_at_end"] + r["waiting_at_end"] == 8  # closed loop: always 8 in flight
    assert r["scheduled_seqs"]["max"] <= 8
    # Some steps carried prompt chunks (more tokens than sequences), some only decodes.
    assert r["tokens_per_step"] > r["scheduled_seqs"]["mean"]
    assert 0 < r["decode_only_steps"] < 300


def word_tokenizer(vocab_size: int = 1200) -> Any:
    """A word-level HF tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_engine_step_with_fake_runner_splits_the_step() -> None:
    r = bench_engine(num_running=6, steps=20, warmup=3, hf_tokenizer=word_tokenizer())
    assert_timings(r, ["step", "overhead", "schedule", "postprocess", "engine_only"])
    assert r["scheduled_seqs"] == {"min": 6, "mean": 6, "max": 6} and r["num_preemptions"] == 0
    assert r["step_us"]["median"] >= r["overhead_us"]["median"] > r["schedule_us"]["median"]


def test_fake_runner_samples_only_sequences_at_their_end() -> None:
    from scheduler.output import SchedulerOutput

    seqs = [bench.Sequence(f"s{i}", [5] * 4, bench.SamplingParams()) for i in range(3)]
    seqs[1].num_computed_tokens = 2  # a chunk of 1 leaves one prompt token uncomputed
    batch = SchedulerOutput(seqs, [4, 1, 4])
    assert bench.fake_sample(batch, 0, [7, 8, 9]) == {"s0": 7, "s2": 9}


def test_model_decode_steps_run_at_n_on_a_tiny_model(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer(300)
    tok.save_pretrained(tmp_path)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    res = bench_model([3, 5], steps=4, warmup=1, dtype="float32", device="cpu",
                      model=str(tmp_path), prompt_len=(8, 40))
    assert set(res) == {3, 5}
    for r in res.values():
        assert r["dtype"] == "torch.float32" and r["steps"] == 4
        assert_timings(r, ["decode_execute", "engine_step"])
        # engine.step() wraps execute(): it cannot be faster than the forward inside it.
        assert r["engine_step_us"]["median"] >= r["decode_execute_us"]["median"]


def test_cli_reports_share_of_a_given_decode_step(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    saved: dict[str, Any] = {}

    def save(name: str, data: dict[str, Any]) -> Path:
        saved[name] = data
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(bench, "save_result", save)
    data = bench.main(["--running", "4", "6", "--steps", "10", "--warmup", "2", "--no-engine",
                       "--decode-step-ms", "2", "4"])
    assert data is saved["scheduler"] and data["machine"]["cpu_count"]
    rows = {(r["num_running"], r["case"]): r for r in data["table"]}
    assert set(rows) == {(4, "decode"), (4, "mixed"), (6, "decode"), (6, "mixed")}
    for (n, _), row in rows.items():
        step_us = {4: 2000.0, 6: 4000.0}[n]
        assert row["decode_step_us"] == step_us
        assert row["sched_pct"] == pytest.approx(100 * row["total_us"]["median"] / step_us)
        assert row["engine_pct"] is None  # --no-engine
    assert data["results"]["model"] == {}  # --decode-step-ms skips the model


def test_cli_rejects_a_decode_step_count_that_does_not_match() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--running", "4", "8", "16", "--decode-step-ms", "1", "2"])
