"""/metrics as vLLM's: names under --metrics-prefix, a model_name label on every series, the
series vLLM dashboards read, the default process and GC collectors."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.metrics import check_prefix
from tests.support.apitools import serve
from tests.support.fake_engine import FakeEngine

# vLLM's metric names that we claim, as vLLM exposes them (counters with their _total).
VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    # Two that vLLM's own Grafana dashboard reads (issue 38: its panels stayed empty).
    "vllm:gpu_cache_usage_perc", "vllm:request_max_num_generation_tokens",
]
DEFAULT_COLLECTORS = ["python_gc_objects_collected_total", "python_gc_collections_total",
                      "python_info", "process_cpu_seconds_total",
                      "process_resident_memory_bytes"]


def scrape(prefix: str, served: str = "my-model") -> dict[str, dict[tuple, float]]:
    """One completion (n=2) and one chat, then /metrics as {sample name: {labels: value}}."""
    with serve(FakeEngine(), metrics_prefix=prefix, served_model_name=served) as client:
        client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
        client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        text = client.get("/metrics").text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_vllm_prefix_gives_vllm_names_with_model_name_on_every_series() -> None:
    samples = scrape("vllm")
    names = set(samples)
    missing = [n for n in VLLM_NAMES
               if not {n, n + "_count", n + "_bucket"} & names]
    assert not missing, missing
    assert set(DEFAULT_COLLECTORS) <= names
    ours = [n for n in names if ":" in n]
    assert ours and all(n.startswith("vllm:") for n in ours)
    for name in ours:  # the default collectors (process_*, python_*) are unlabelled, as in vLLM
        for labels in samples[name]:
            assert ("model_name", "my-model") in labels, (name, labels)


def test_request_series_values() -> None:
    s = scrape("pagedserve")
    one = (("model_name", "my-model"),)

    def count(name: str) -> float:
        return s[f"pagedserve:{name}_count"][one]

    # 3 engine requests (2 choices + 1 chat), each with the fake engine's timings
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert count(name) == 3, name
    assert s["pagedserve:request_decode_time_seconds_sum"][one] == pytest.approx(0.09)
    assert s["pagedserve:request_generation_tokens_sum"][one] == 3 + 3 + 4
    assert s["pagedserve:request_time_per_output_token_seconds_sum"][one] == pytest.approx(
        0.03 / 2 * 2 + 0.03 / 3)
    # params: once per API request, n as asked
    assert count("request_params_n") == 2
    assert s["pagedserve:request_params_n_sum"][one] == 3
    assert s["pagedserve:request_params_max_tokens_sum"][one] == 7
    # the most tokens of each request's choices: max(3, 3) for the completion, 4 for the chat
    assert count("request_max_num_generation_tokens") == 2
    assert s["pagedserve:request_max_num_generation_tokens_sum"][one] == 3 + 4
    assert s["pagedserve:gpu_cache_usage_perc"][one] == s["pagedserve:kv_cache_usage_perc"][one]
    assert count("time_per_output_token_seconds") == count("inter_token_latency_seconds") == 7
    info = next(iter(s["pagedserve:cache_config_info"]))
    assert dict(info)["model_name"] == "my-model" and "block_size" in dict(info)


@pytest.mark.parametrize("prefix", ["", "vllm:", "1abc", "a-b"])
def test_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="metrics prefix"):
        check_prefix(prefix)
    with pytest.raises(ValueError, match="metrics prefix"):
        create_app(FakeEngine(), metrics_prefix=prefix)


def test_the_engines_memory_account_is_served_by_kind() -> None:
    """memory_bytes{kind}: the account engine/worker/memory.py makes once the engine is ready
    (issue 37), one series per kind, from the engine's stats."""
    from prometheus_client import CollectorRegistry, generate_latest

    from api.metrics import EngineCollector
    from engine.protocol import EngineStats

    class Ready(FakeEngine):
        def stats(self) -> EngineStats:
            return EngineStats(memory=(("dense_weights", 1024), ("kv_pool", 4096),
                                       ("resident", 9000)))

    registry = CollectorRegistry()
    registry.register(EngineCollector(Ready(), "vllm", "m"))  # type: ignore[arg-type]
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    got = {s.labels["kind"]: s.value for s in families["vllm:memory_bytes"].samples}
    assert got == {"dense_weights": 1024, "kv_pool": 4096, "resident": 9000}
    assert all(s.labels["model_name"] == "m" for s in families["vllm:memory_bytes"].samples)


def test_speculative_decoding_counters_under_vllms_names() -> None:
    """vllm:spec_decode_* (issue 35), only while speculation is on, per position too."""
    from prometheus_client import CollectorRegistry, generate_latest

    from api.metrics import EngineCollector
    from engine.protocol import EngineStats

    def families(stats: EngineStats) -> dict[str, Any]:
        class Engine(FakeEngine):
            def stats(self) -> EngineStats:
                return stats

        registry = CollectorRegistry()
        registry.register(EngineCollector(Engine(), "vllm", "m"))  # type: ignore[arg-type]
        return {f.name: f for f in text_string_to_metric_families(
            generate_latest(registry).decode())}

    assert not [name for name in families(EngineStats()) if "spec_decode" in name]
    got = families(EngineStats(spec_num_drafts=5, spec_num_draft_tokens=18,
                               spec_num_accepted_tokens=9, spec_accepted_per_pos=(5, 3, 1, 0)))
    values = {name: [(s.name, s.labels.get("position"), s.value) for s in f.samples]
              for name, f in got.items() if "spec_decode" in name}
    assert values == {
        "vllm:spec_decode_num_drafts": [("vllm:spec_decode_num_drafts_total", None, 5.0)],
        "vllm:spec_decode_num_draft_tokens": [
            ("vllm:spec_decode_num_draft_tokens_total", None, 18.0)],
        "vllm:spec_decode_num_accepted_tokens": [
            ("vllm:spec_decode_num_accepted_tokens_total", None, 9.0)],
        "vllm:spec_decode_num_accepted_tokens_per_pos": [
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i), float(v))
            for i, v in enumerate((5, 3, 1, 0))],
    }
