"""bench_peers: the classes issue 32 names, the peers' command lines, unavailable peers
reported with their reason, weight bytes and the weight-read share, the targets, and a whole
run on a tiny checkpoint (pagedserve up, the peers unavailable as they are in CI). The
OpenVINO wrapper's step loop against a fake pipeline."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import bench_peers
from benchmarks.baselines import llama_cpp, openvino_genai
from benchmarks.baselines.generation import Row
from benchmarks.bench_peers_report import checks
from tests.support.models import build_checkpoint


def test_the_classes_hold_the_servers_issue_32_names() -> None:
    by_class: dict[str, list[str]] = {}
    for e in bench_peers.ENTRIES:
        by_class.setdefault(e.klass, []).append(e.artifact if e.name.startswith("pagedserve")
                                                else e.name)
    assert by_class == {"bf16": ["safetensors", "vllm-cpu-bf16"],
                        "int8": ["safetensors", "safetensors", "llama.cpp-q8_0", "openvino-int8"],
                        "int4": ["safetensors", "gguf:Q4_0", "llama.cpp-q4_0", "openvino-int4"]}


def _spec(name: str, path: str = "/m", parallel: int = 16) -> bench_peers.PreparedSpec:
    entry = next(e for e in bench_peers.ENTRIES if e.name == name)
    return bench_peers.PreparedSpec(entry, Path(path), parallel)


def test_llama_server_gets_a_slot_per_stream_and_flash_attention() -> None:
    argv = _spec("llama.cpp-q4_0", "/g/m-q4_0.gguf", 16).command(Path("/x"), "bfloat16", 9000, [])
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == str(16 * 512)
    assert argv[argv.index("-fa") + 1] == "on" and argv[argv.index("-m") + 1] == "/g/m-q4_0.gguf"


def test_pagedserve_serves_the_prepared_file_with_its_mode() -> None:
    argv = _spec("pagedserve-int4", "/f").command(Path("/x"), "bfloat16", 9000, [])
    assert argv[argv.index("--model") + 1] == "/f"
    assert argv[argv.index("--quantization") + 1] == "int4"
    gguf = _spec("pagedserve-gguf-q4_0", "/g.gguf").command(Path("/x"), "bfloat16", 9000, [])
    assert "--quantization" not in gguf and gguf[gguf.index("--model") + 1] == "/g.gguf"
    ov = _spec("openvino-int8", "/ir").command(Path("/x"), "bfloat16", 9000, [])
    assert ov[ov.index("--serve") + 1] == "/ir" and str(openvino_genai.venv_python()) in ov


def _no_peers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As in CI: llama.cpp not built, no OpenVINO or vLLM venv."""
    monkeypatch.setattr(llama_cpp, "binary", lambda name: tmp_path / "none" / name)
    monkeypatch.setenv("PAGEDSERVE_OPENVINO_VENV", str(tmp_path / "no-ov"))
    monkeypatch.setenv("PAGEDSERVE_VLLM_VENV", str(tmp_path / "no-vllm"))


def test_a_peer_that_is_not_built_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    _no_peers(monkeypatch, tmp_path)
    for name, words in (("llama.cpp-q8_0", "not built"), ("openvino-int4", "no OpenVINO venv"),
                        ("vllm-cpu-bf16", "vLLM venv not found")):
        entry = next(e for e in bench_peers.ENTRIES if e.name == name)
        with pytest.raises(RuntimeError, match=words):
            bench_peers.artifact(entry, tmp_path, make=False)


def test_weight_bytes_take_the_weights_a_step_reads(tmp_path: Path) -> None:
    ours = next(e for e in bench_peers.ENTRIES if e.name == "pagedserve-int8")
    metrics = ('pagedserve:memory_bytes{kind="dense_weights",model_name="m"} 3000.0\n'
               'pagedserve:memory_bytes{kind="quantized_weights",model_name="m"} 5000.0\n'
               'pagedserve:memory_bytes{kind="dense_copies",model_name="m"} 9000.0\n'
               'pagedserve:memory_bytes{kind="kv_pool",model_name="m"} 7.0e+04\n')
    # the head is a quantized copy: the dense embedding (2000) is read a row at a time
    assert bench_peers.weight_bytes(ours, tmp_path, metrics, 2000) == 6000
    dense = metrics.replace('kind="quantized_weights"', 'kind="packed_weights"')
    assert bench_peers.weight_bytes(ours, tmp_path, dense, 2000) == 8000  # tied head: all read
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 1234)
    llama = next(e for e in bench_peers.ENTRIES if e.name == "llama.cpp-q4_0")
    assert bench_peers.weight_bytes(llama, gguf, None, 2000) == 1234


def _row(server: str, klass: str, tok_s: float, itl: float, weights: int | None = None,
         share: float | None = None) -> dict[str, Any]:
    return {"server": server, "class": klass, "status": "ok", "weight_bytes": weights,
            "rss_bytes": None, "c1_tok_s": tok_s, "c1_itl_p50_ms": itl, "c16_tok_s": tok_s * 8,
            "c1_weight_read_gb_s": share, "c1_weight_read_share": None}


def test_targets_compare_the_best_of_ours_with_each_peer_in_its_class() -> None:
    data = {"bandwidth": {"copy_gb_s": 10.0}, "summary": [
        _row("pagedserve-int4", "int4", 10.0, 60.0), _row("pagedserve-gguf-q4_0", "int4", 12.0, 55.0),
        _row("llama.cpp-q4_0", "int4", 11.0, 50.0), _row("pagedserve-bf16", "bf16", 5.0, 200.0,
                                                          share=8.0)]}
    got = {c["check"]: (round(c["value"], 3), c["pass"]) for c in checks(data)}
    assert got["int4 c1 tok/s: best pagedserve / llama.cpp-q4_0"] == (round(12 / 11, 3), True)
    assert got["int4 c1 ITL p50: best pagedserve / llama.cpp-q4_0"] == (1.1, False)
    assert got["int4 c16 tok/s: best pagedserve / llama.cpp-q4_0"] == (round(12 / 11, 3), False)
    assert got["pagedserve-bf16 c1 weight-read rate / copy bandwidth"] == (0.8, True)


def test_a_run_on_a_tiny_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_peers(monkeypatch, tmp_path)
    folder = build_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.setattr(bench_peers, "wait_for_idle", lambda *a, **k: {"idle": True})
    real = bench_peers.bandwidth
    monkeypatch.setattr(bench_peers, "bandwidth", lambda threads: real(threads, mib=8, repeats=2))
    args = bench_peers.parse_args([
        "--model", str(folder), "--classes", "int8", "--concurrency", "1", "2",
        "--servers", "pagedserve-int8", "llama.cpp-q8_0", "openvino-int8",
        "--output-tokens", "4", "--out", str(tmp_path / "out"), "--startup-timeout", "300"])
    args.server_args = {"pagedserve-int8": ["--enforce-eager"]}  # compiling is not under test
    data, path = bench_peers.run(args)
    servers = data["servers"]
    assert servers["llama.cpp-q8_0"]["status"] == "unavailable"
    assert "not built" in servers["llama.cpp-q8_0"]["reason"]
    assert servers["openvino-int8"]["status"] == "unavailable"
    ours = servers["pagedserve-int8"]
    assert ours["status"] == "ok" and ours["weight_bytes"] > 0 and ours["rss_bytes"] > 0
    assert {"c1", "c2"} <= set(ours["runs"]) and ours["runs"]["c1"]["completed"] == 2
    row = next(r for r in data["summary"] if r["server"] == "pagedserve-int8")
    assert row["c1_weight_read_share"] > 0
    assert data["bandwidth"]["copy_gb_s"] > 0 and data["bandwidth"]["read_gb_s"] > 0
    assert json.loads(path.read_text())["checks"] == data["checks"]
    assert path.with_suffix(".png").is_file()


# --- the OpenVINO wrapper's loop, against a fake pipeline ---


class FakeHandle:
    """Emits one token a step (the step count), finished after max_new_tokens."""

    def __init__(self, config: Any) -> None:
        self.config, self.made, self.cancelled = config, 0, False
        self.unread: list[int] = []

    def advance(self) -> None:
        if self.made < self.config.max_new_tokens and not self.cancelled:
            self.made += 1
            self.unread.append(100 + self.made)

    def can_read(self) -> bool:
        return bool(self.unread)

    def read(self) -> dict[int, Any]:
        out, self.unread = self.unread, []
        return {0: SimpleNamespace(generated_ids=out)}

    def get_status(self) -> str:
        return "running" if self.made < self.config.max_new_tokens else "finished"

    def cancel(self) -> None:
        self.cancelled = True


class FakePipe:
    def __init__(self) -> None:
        self.handles: dict[int, FakeHandle] = {}
        self.prompts: dict[int, Any] = {}

    def add_request(self, rid: int, tensor: Any, config: Any) -> FakeHandle:
        self.handles[rid], self.prompts[rid] = FakeHandle(config), tensor
        return self.handles[rid]

    def step(self) -> None:
        time.sleep(0.005)  # a step takes time: a client can leave in the middle of a request
        for h in self.handles.values():
            h.advance()


FAKE_GENAI = SimpleNamespace(GenerationConfig=SimpleNamespace,
                             GenerationStatus=SimpleNamespace(RUNNING="running"))


def test_the_openvino_loop_streams_each_request_and_drops_a_cancelled_one() -> None:
    pipe = FakePipe()
    ours, theirs = multiprocessing.Pipe()
    engine = openvino_genai.PipelineLoop(pipe, FAKE_GENAI, lambda ids: ("tensor", ids), theirs)
    thread = threading.Thread(target=engine.run)  # the child process's loop, here on a thread
    thread.start()
    client = openvino_genai.PipelineClient(ours, frozenset({1}))

    async def drive() -> tuple[list[Any], Any]:
        a, b = Row([5, 6], 3, True), Row([7], 200, True)
        client.submit(a)
        client.submit(b)
        got_a = [await a.queue.get() for _ in range(3)]
        first_b = await b.queue.get()
        b.cancelled = True  # the client left after one token
        return got_a, first_b

    try:
        got_a, first_b = asyncio.run(drive())
        deadline = time.monotonic() + 10
        while not pipe.handles[1].cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        client.stop()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert got_a == [(101, None), (102, None), (103, "length")]
    assert first_b == (101, None)
    assert pipe.prompts[0] == ("tensor", [5, 6])
    assert pipe.handles[1].cancelled and pipe.handles[1].made < 200
    assert pipe.handles[0].config.ignore_eos and pipe.handles[0].config.do_sample is False
