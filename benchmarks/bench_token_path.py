"""Per-token cost of a streamed token, before (a git worktree of the base commit) and after (this
tree), each side in its own subprocesses, the two interleaved round by round; medians (issue 34
parts 4 and 5).

api: RequestOutput -> SSE bytes. The real app, called as uvicorn calls it (its lifespan run
first; no socket, no model): a StreamTable delivers one synthetic delta per choice at a time on
the event loop, as the engine client's call_soon_threadsafe callback does, and the time until
the app has handed that delta's SSE chunk to the ASGI `send` is taken per token. Cases:
/v1/completions and /v1/chat/completions at n=1, chat at n=2 (both choices' deltas in one
delivery, as one engine step delivers them).

detok: token ids -> text deltas on SmolLM2's tokenizer, one token per step after a chat prompt,
with no stop string and with one that never matches: the detokenizer the engine makes for it
(before: IncrementalDetokenizer; after: new_detokenizer's choice).

    .venv/bin/python -m benchmarks.bench_token_path                  # base: HEAD
    .venv/bin/python -m benchmarks.bench_token_path --base-ref eed5500 --rounds 9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_TREE = Path("/tmp/base-tokpath")
API_CASES = {"completions_n1": ("/v1/completions", 1), "chat_n1": ("/v1/chat/completions", 1),
             "chat_n2": ("/v1/chat/completions", 2)}
TEXT = ("Hello world, this is a streaming test. 中文文本，日本語のテキスト 😀👍🏽 and café naïve. "
        "The quick brown fox jumps over the lazy dog; 1, 2, 3.\n") * 60


# --- the worker: one tree, every case --------------------------------------------------------

def worker(root: Path, part: str, tokens: int, requests: int) -> dict[str, float]:
    """{case: median µs per token over `requests` runs} for wall time and, as case + "_cpu",
    for this process's CPU time (the loop is one thread that never waits on I/O, so its CPU
    time is the same work with less of what other processes on a shared box take),
    importing the code under `root`."""
    sys.path.insert(0, str(root))
    if part == "api":
        return asyncio.run(_api_cases(tokens, requests))
    return _detok_cases(tokens, requests)


async def _api_cases(tokens: int, requests: int) -> dict[str, float]:
    from api.app import create_app

    engine = _driven_engine()
    app = create_app(engine)
    lifespan = await _start_lifespan(app)
    while not engine.is_ready():
        await asyncio.sleep(0.001)
    out: dict[str, float] = {}
    for case, (route, n) in API_CASES.items():
        await _stream(app, engine, route, n, 50)  # warm-up
        runs = [await _stream(app, engine, route, n, tokens) for _ in range(requests)]
        out[case] = statistics.median(wall for wall, _ in runs) * 1e6
        out[case + "_cpu"] = statistics.median(cpu for _, cpu in runs) * 1e6
    lifespan.cancel()
    return out


def _driven_engine() -> Any:
    """The test suite's FakeEngine whose submit() opens a StreamTable stream the benchmark feeds
    (the thread and process clients' table: tests/engine/test_stream_table.py)."""
    from engine.client.stream_table import StreamTable
    from tests.support.fake_engine import FakeEngine

    class Driven(FakeEngine):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(max_model_len=1 << 20)
            self.table = StreamTable(self._close)
            self.opened: list[str] = []

        async def submit(self, request_id: str, prompt: list[int], params: Any,
                         priority: int = 0, deadline: float | None = None) -> Any:
            stream, admitted = self.table.open(asyncio.get_running_loop(), request_id)
            self.table.admit(request_id, None)
            await admitted
            self.opened.append(request_id)
            return stream

    return Driven()


async def _start_lifespan(app: Any) -> asyncio.Task[None]:
    started = asyncio.Event()
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    inbox.put_nowait({"type": "lifespan.startup"})

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                   inbox.get, send))
    await started.wait()
    return task


async def _stream(app: Any, engine: Any, route: str, n: int,
                  tokens: int) -> tuple[float, float]:
    """Wall and CPU seconds per token of one streamed request: `tokens` deltas per choice,
    each delivered once the previous one's chunks were sent."""
    sent, want = [0], [0]
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def send(message: dict[str, Any]) -> None:
        nonlocal ready
        if message["type"] == "http.response.body" and message.get("body"):
            sent[0] += 1
            if sent[0] >= want[0] and not ready.done():
                ready.set_result(None)

    body = _body(route, n, tokens)
    first = len(engine.opened)
    task = asyncio.create_task(app(_scope(route), _receive(body), send))
    while len(engine.opened) < first + n:
        await asyncio.sleep(0)
    rids = engine.opened[first:]
    await asyncio.sleep(0.01)  # the response has started (chat: its role chunks are out)
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(tokens):
        want[0] = sent[0] + n
        ready = asyncio.get_running_loop().create_future()
        engine.table.deliver([_delta(rid, k, tokens) for rid in rids])
        await ready
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    await task
    return wall / tokens, cpu / tokens


def _body(route: str, n: int, tokens: int) -> bytes:
    req: dict[str, Any] = {"model": "fake-model", "max_tokens": tokens, "n": n, "stream": True}
    if route.endswith("/chat/completions"):
        req["messages"] = [{"role": "user", "content": "Tell me a story."}]
    else:
        req["prompt"] = "Once upon a time"
    return json.dumps(req).encode()


def _scope(route: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"bench"), (b"content-type", b"application/json")]}


def _receive(body: bytes) -> Any:
    """The body once, then nothing until the response is done (the client stays)."""
    given = [False]
    forever = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if not given[0]:
            given[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    return receive


def _delta(rid: str, k: int, tokens: int) -> Any:
    """Token k of `tokens`: the first carries the prompt, the last the finish and timings."""
    from engine.outputs import RequestOutput, RequestTimings

    last = k == tokens - 1
    return RequestOutput(
        rid, (1000 + k,), " tok", prompt_token_ids=(1, 2, 3) if k == 0 else None,
        num_prompt_tokens=3, num_output_tokens=k + 1,
        finish_reason="length" if last else None, queue_time=0.001 if last else None,
        timings=RequestTimings(0.001, 0.002, 0.03, 0.032) if last else None)


def _detok_cases(tokens: int, requests: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from benchmarks.common import model_folder
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer
    from scheduler.sampling_params import SamplingParams

    try:
        from engine.stream_detokenizer import new_detokenizer as make
    except ImportError:  # before: the engine made IncrementalDetokenizer
        make = IncrementalDetokenizer
    tok = Tokenizer(AutoTokenizer.from_pretrained(model_folder()))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say it."}]))
    ids = tok.encode(TEXT)[:tokens]
    out: dict[str, float] = {}
    for case, stop in (("detok", ()), ("detok_stop_string", ("<never>",))):
        params = SamplingParams(stop=stop)
        walls, cpus = [], []
        for _ in range(requests):
            t0, c0 = time.perf_counter(), time.process_time()
            detok = make(tok, prompt, params)
            text = "".join(detok.step([i])[0] for i in ids) + detok.flush()
            walls.append((time.perf_counter() - t0) / len(ids))
            cpus.append((time.process_time() - c0) / len(ids))
        assert text == tok.decode(ids), "the deltas do not add up to the text"
        out[case] = statistics.median(walls) * 1e6
        out[case + "_cpu"] = statistics.median(cpus) * 1e6
    return out


# --- the driver: both trees, interleaved -----------------------------------------------------

def base_tree(ref: str) -> tuple[Path, str]:
    """A worktree of `ref` at BASE_TREE (made, or moved to `ref`); -> (path, its commit)."""
    commit = _git(ROOT, "rev-parse", ref)
    if not (BASE_TREE / ".git").exists():
        _git(ROOT, "worktree", "add", "--detach", str(BASE_TREE), commit)
    else:
        _git(BASE_TREE, "checkout", "--detach", commit)
    return BASE_TREE, commit


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def run_worker(root: Path, part: str, tokens: int, requests: int) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--root", str(root),
           "--part", part, "--tokens", str(tokens), "--requests", str(requests)]
    done = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(base: Path, rounds: int, tokens: int, requests: int,
            parts: list[str]) -> dict[str, Any]:
    """Per round, each part on both trees (which goes first alternates); -> the rounds and
    per case the medians (µs per token) and their ratio."""
    trees = {"before": base, "after": ROOT}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for r in range(rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for part in parts:
            for side in order:
                for case, us in run_worker(trees[side], part, tokens, requests).items():
                    samples[side].setdefault(case, []).append(us)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{c} {samples['before'][c][-1]:.1f}->{samples['after'][c][-1]:.1f}"
            for c in samples["after"]), flush=True)
    cases = {c: {"before_us": statistics.median(samples["before"][c]),
                 "after_us": statistics.median(samples["after"][c])}
             for c in samples["after"]}
    for c in cases.values():
        c["speedup"] = c["before_us"] / c["after_us"]
    return {"cases": cases, "samples_us": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-ref", default="HEAD", help="the 'before' commit (default HEAD)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2000, help="deltas per request")
    ap.add_argument("--requests", type=int, default=3, help="requests per case per worker")
    ap.add_argument("--parts", nargs="+", default=["api", "detok"], choices=["api", "detok"])
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--part", default="api", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.root, args.part, args.tokens, args.requests)))
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import machine_info, machine_slug, save_result

    info = machine_info()
    base, commit = base_tree(args.base_ref)
    result = compare(base, args.rounds, args.tokens, args.requests, args.parts)
    dirty = bool(_git(ROOT, "status", "--porcelain", "--", "api", "engine"))
    data = {"benchmark": "token_path", "machine": info, "base_commit": commit,
            "after": {"commit": _git(ROOT, "rev-parse", "HEAD"), "uncommitted_changes": dirty},
            "config": vars(args) | {"root": str(ROOT)}, **result}
    for case, c in result["cases"].items():
        print(f"{case:20s} before {c['before_us']:7.2f} µs/token  after {c['after_us']:7.2f}"
              f"  ({c['speedup']:.2f}x)")
    if not args.no_save:
        print("saved", save_result(f"token-path-{machine_slug(info)}", data))


if __name__ == "__main__":
    main()
