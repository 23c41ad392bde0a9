"""pagedserve as a Ray Serve application: 2 replicas of the tiny model (1 torch thread each)
behind Serve's HTTP proxy on loopback. Streaming, disconnects, backpressure, a killed
replica, /metrics and /health, and a focused subset of the API, through Ray.

The tests share one cluster and one deployment (module fixtures) and run in file order: the
killed replica, then the prefix-affinity comparison and autoscaling, which deploy apps of
their own in its place, come last (those two are `heavy`: `pytest -m heavy`)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from api.replicas.launch import APP_NAME
from api.replicas.options import ReplicaOptions
from tests.replicas.conftest import replica_config
from tests.support.ray_serve import RayCluster, deployed, replica_metrics

RUNNING = "pagedserve:num_requests_running"
FREE = "pagedserve:num_free_kv_blocks"
TOTAL = "pagedserve:num_kv_blocks"


@pytest.fixture(scope="module")
def url(cluster: RayCluster, tiny_model: Path) -> Iterator[str]:
    with deployed(cluster, replica_config(tiny_model), ReplicaOptions(num_replicas=2)) as u:
        wait_replicas(u, 2)
        yield u


def wait_replicas(url: str, n: int, timeout: float = 90.0, without: str | None = None
                  ) -> dict[str, dict[str, float]]:
    """Wait until /metrics shows exactly n replicas (none of them `without`: a dead replica's
    last report stays fresh for STALE_AFTER_S); returns the metrics read."""
    deadline = time.monotonic() + timeout
    while True:
        m = replica_metrics(url)
        shown = m.get(TOTAL, {})
        if len(shown) == n and without not in shown:
            return m
        assert time.monotonic() < deadline, f"replicas: {sorted(m.get(TOTAL, {}))}, want {n}"
        time.sleep(0.2)


def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Every replica: nothing running and every KV block free."""
    deadline = time.monotonic() + timeout
    while True:
        m = replica_metrics(url)
        busy = {r: v for r, v in m[RUNNING].items() if v} or {
            r: m[FREE][r] for r in m[FREE] if m[FREE][r] != m[TOTAL][r]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"replicas not idle: {busy}"
        time.sleep(0.1)


def wait_reported(url: str, done: Callable[[dict[str, dict[str, float]]], bool],
                  timeout: float = 30.0) -> dict[str, dict[str, float]]:
    """The first /metrics read where every replica is idle and `done` holds. The ingress
    shows each replica's last report (pushed every REPORT_PERIOD_S, read as often), so a
    fixed sleep after a request may still see counters from before it: poll instead."""
    deadline = time.monotonic() + timeout
    while True:
        m = replica_metrics(url)
        idle = not any(m[RUNNING].values()) and m[FREE] == m[TOTAL]
        if idle and done(m):
            return m
        assert time.monotonic() < deadline, "the replicas' reports never showed it"
        time.sleep(0.1)


def events(lines: list[str]) -> list[str]:
    return [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]


# ---- a focused subset of the API, through Ray ------------------------------------------------


def test_completion_chat_and_models_through_the_proxy(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 5,
                                                  "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 5
    again = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 5,
                                                      "temperature": 0}, timeout=30).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]  # greedy, any replica
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=30)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    models = httpx.get(url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    tok = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=10).json()
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]},
                      timeout=10).json()["prompt"].endswith("hello")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": [9999999], "max_tokens": 2}, "prompt"),
    ({"prompt": "x " * 600, "max_tokens": 2}, "prompt"),
])
def test_bad_requests_are_400s_naming_the_param(url: str, body: dict[str, object],
                                                param: str) -> None:
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_a_404_and_health_is_200(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/health", timeout=10).status_code == 200


# ---- streaming and disconnects ---------------------------------------------------------------


def test_chunks_arrive_as_they_are_generated(url: str) -> None:
    """480 tokens take the tiny model over a second: the first event must come long before
    the last, and while its replica reports the request running."""
    body = {"prompt": "stream me", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        t_first = time.monotonic()
        seen_running = any(v > 0 for v in replica_metrics(url)[RUNNING].values())
        rest = events(list(lines))
        t_last = time.monotonic()
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 480
    assert len(rest) > 100  # one event per delta, not one blob
    assert seen_running or t_last - t_first > 0.3, (t_last - t_first)


def test_client_disconnect_frees_the_replicas_kv_blocks(url: str) -> None:
    """Hang up after 3 events: the replica aborts the request (it computes far fewer than
    the 8 + 500 tokens a finished one would), the ingress counts an abort, and every
    replica ends with nothing running and every KV block free. The longest output the tiny
    model's 512 positions allow: the abort races the decode, and on a loaded box (the suite
    beside other work) 300 tokens were once all decoded before it landed."""
    wait_idle(url)
    steps = "pagedserve:iteration_tokens_total_sum"
    before = sum(replica_metrics(url)[steps].values())
    prompt = list(range(2, 10))  # 8 tokens
    body = {"prompt": prompt, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        got = [ln for _, ln in zip(range(3), (x for x in r.iter_lines() if x.startswith("data")),
                                   strict=False)]
        assert len(got) == 3
    # Hung up mid-stream: aborted, its blocks back in the pool. An idle report may predate
    # the request (reports lag up to ~2 x REPORT_PERIOD_S), so wait for one that has its prompt.
    m = wait_reported(url, lambda m: sum(m[steps].values()) - before >= 8, timeout=10)
    computed = sum(m[steps].values()) - before
    assert 8 <= computed < 8 + 500 - 50, computed
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'finished_reason="abort"' in text


# ---- backpressure ----------------------------------------------------------------------------


def test_full_queues_answer_429_with_retry_after(url: str) -> None:
    """Each replica runs 8 and queues 2 (max_num_queued_reqs); Serve sends it at most 11: the
    11th is refused by its engine, as a 429 with Retry-After through the proxy. Every stream
    stays open until all 22 have their answer (closing one aborts it and frees its slot)."""
    wait_idle(url)
    answered = 0
    all_answered = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        nonlocal answered
        body = {"prompt": [2 + i] * 8, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            answered += 1
            if answered == 22:
                all_answered.set()
            await asyncio.wait_for(all_answered.wait(), 60)
            return r.status_code, r.headers.get("retry-after")  # closing hangs up: aborts

    async def burst() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(22)))

    results = asyncio.run(burst())
    refused = [ra for status, ra in results if status == 429]
    assert refused, results
    assert all(ra is not None and int(ra) >= 1 for ra in refused)
    assert {status for status, _ in results} <= {200, 429}
    wait_idle(url)


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_have_a_row_per_replica(url: str) -> None:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = replica_metrics(url)
    assert len(m[TOTAL]) == 2 and all(v == 400 for v in m[TOTAL].values())
    assert set(m["pagedserve:prefix_cache_queries_total"]) == set(m[TOTAL])
    assert "pagedserve:time_to_first_token_seconds_bucket" in text  # API-edge series too


def test_live_view_has_a_panel_per_replica_with_its_snapshot(url: str) -> None:
    """issue 36: /v1/engine/events through the ingress: one engine per replica, named as in
    /metrics; once watched, each replica's reports carry its steps, blocks and requests."""
    wait_idle(url)
    replicas = set(replica_metrics(url)[TOTAL])

    def look() -> list[dict[str, object]]:
        with httpx.stream("GET", url + "/v1/engine/events?max_events=1", timeout=30) as r:
            assert r.status_code == 200
            data = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
        engines: list[dict[str, object]] = json.loads(data.removeprefix("data: "))["engines"]
        return engines

    def until(done: Callable[[list[dict[str, object]]], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not done(look()):
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    assert {e["name"] for e in look()} == replicas
    # The snapshots come with the replicas' next reports, once the board says "watched".
    until(lambda seen: all(len(str(e["kv_blocks"])) == 400 for e in seen), "no snapshots")
    # Long enough to run across several 250 ms reports: 64 tokens could start and finish
    # between two of them on a fast CPU (it failed so once), ~400 take the tiny model ~1 s.
    body = {"prompt": "hello " * 20, "max_tokens": 400, "ignore_eos": True}
    worker = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                              kwargs={"json": body, "timeout": 60})
    worker.start()
    try:
        until(lambda seen: any(e["requests"] and "2" in str(e["kv_blocks"]) for e in seen),
              "no replica showed the running request and its blocks")
    finally:
        worker.join(60)
    until(lambda seen: not any(e["requests"] or "2" in str(e["kv_blocks"]) for e in seen),
          "the finished request is still shown")
    assert any(e["steps"] for e in look())  # the serving replica's recent steps


# ---- a killed replica ------------------------------------------------------------------------


def engine_actor(replica: str) -> ray.actor.ActorHandle:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"#{replica}")]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def test_killed_replica_fails_only_its_requests_and_recovers(url: str) -> None:
    wait_idle(url)

    async def stream(client: httpx.AsyncClient, i: int, started: asyncio.Event
                     ) -> list[str]:
        body = {"prompt": [2 + i] * 8, "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            out: list[str] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
            return out

    async def scenario() -> tuple[list[list[str]], str]:
        async with httpx.AsyncClient(timeout=60) as client:
            flags = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(stream(client, i, f)) for i, f in enumerate(flags)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 30)
            running = replica_metrics(url)[RUNNING]
            victim = max(running, key=lambda r: running[r])
            ray.kill(engine_actor(victim), no_restart=False)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), victim

    results, victim = asyncio.run(scenario())
    failed = [ev for ev in results if any('"error"' in e for e in ev)]
    finished = [ev for ev in results if ev not in failed]
    assert failed, "the killed replica served no stream"
    for ev in failed:  # an error event, then [DONE]: nothing hangs
        assert ev[-1] == "[DONE]" and "engine" in json.loads(ev[-2])["error"]["message"]
    for ev in finished:
        assert ev[-1] == "[DONE]"
        assert json.loads(ev[-2])["choices"][0]["finish_reason"] == "length"
    # New requests go to the healthy replica while Ray replaces the dead one.
    for i in range(4):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"after {i}", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    m = wait_replicas(url, 2, without=victim)  # a new replica took its place
    assert victim not in m[TOTAL] and len(m[TOTAL]) == 2


# ---- prefix affinity -------------------------------------------------------------------------


def affinity_workload(seed: int) -> list[list[int]]:
    """8 shared prefixes of 400 tokens (contents from `seed`), 6 requests each with a short
    distinct tail, in one shuffled order (fixed: the same for every seed)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 300) for _ in range(400)] for _ in range(8)]
    order = [i for i in range(8) for _ in range(6)]
    random.Random(0).shuffle(order)
    return [prefixes[i] + [rng.randrange(2, 300) for _ in range(8)] for i in order]


def prefix_misses(url: str, prompts: list[list[int]], in_flight: int = 8) -> float:
    """Prompt tokens not found in the prefix cache, summed over replicas (from /metrics)."""
    def queried(m: dict[str, dict[str, float]]) -> float:
        return sum(m["pagedserve:prefix_cache_queries_total"].values())

    def missed(m: dict[str, dict[str, float]]) -> float:
        return queried(m) - sum(m["pagedserve:prefix_cache_hits_total"].values())

    async def run() -> None:
        gate = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(p: list[int]) -> None:
                async with gate:
                    r = await client.post(url + "/v1/completions",
                                          json={"prompt": p, "max_tokens": 4})
                    assert r.status_code == 200, r.text
            await asyncio.gather(*(one(p) for p in prompts))

    wait_idle(url)
    before = replica_metrics(url)
    asyncio.run(run())
    # Every prompt is counted at its admission: wait for the reports that hold them all.
    prompt_tokens = sum(map(len, prompts))
    after = wait_reported(url, lambda m: queried(m) - queried(before) >= prompt_tokens)
    return missed(after) - missed(before)


@pytest.mark.heavy  # ~35 s (two apps deployed in turn); tests/replicas/test_prefix_index.py
# keeps the routing rule in the default run
def test_prefix_aware_routing_misses_fewer_prefix_tokens(cluster: RayCluster,
                                                         tiny_model: Path) -> None:
    """Prefix-aware, then round-robin, each on fresh replicas with new prefixes. A 64-token
    step budget (the default preset's cap while others decode) serialises prefills, so a
    request seldom arrives while its prefix's first request is still prefilling: the
    comparison measures routing, not that race (docs/scaling.md has both settings)."""
    misses = {}
    serve.delete(APP_NAME)
    with deployed(cluster, replica_config(tiny_model, max_num_batched_tokens=64),
                  ReplicaOptions(num_replicas=2, routing="prefix-aware")) as u:
        wait_replicas(u, 2)
        misses["prefix-aware"] = prefix_misses(u, affinity_workload(seed=0))
    with deployed(cluster, replica_config(tiny_model, max_num_batched_tokens=64),
                  ReplicaOptions(num_replicas=2, routing="round-robin")) as u:
        wait_replicas(u, 2)
        misses["round-robin"] = prefix_misses(u, affinity_workload(seed=1))
    print(f"prefix-cache misses (tokens): {misses}")
    assert misses["round-robin"] >= 1.4 * misses["prefix-aware"], misses


# ---- autoscaling -----------------------------------------------------------------------------


def keep_busy(url: str, in_flight: int, stop: threading.Event) -> None:
    """Keep `in_flight` long requests running until `stop` is set (on a thread)."""
    async def worker(client: httpx.AsyncClient, i: int) -> None:
        while not stop.is_set():
            body = {"prompt": f"load {i} " * 4, "max_tokens": 200, "ignore_eos": True}
            await client.post(url + "/v1/completions", json=body)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(worker(client, i) for i in range(in_flight)))

    asyncio.run(run())


@pytest.mark.heavy  # ~45 s of scaling up and down; `pytest -m heavy` runs it
def test_autoscaling_adds_a_replica_under_a_burst_and_drops_it_when_idle(
        cluster: RayCluster, tiny_model: Path) -> None:
    opts = ReplicaOptions(num_replicas=None, min_replicas=1, max_replicas=2,
                          target_ongoing_requests=2, upscale_delay_s=0.5,
                          downscale_delay_s=2.0, look_back_period_s=1.0)
    with deployed(cluster, replica_config(tiny_model), opts) as u:
        wait_replicas(u, 1)
        stop = threading.Event()
        load = threading.Thread(target=keep_busy, args=(u, 8, stop))
        load.start()
        try:
            wait_replicas(u, 2, timeout=180)  # 8 in flight against a target of 2 per replica
        finally:
            stop.set()
            load.join(timeout=120)
        assert not load.is_alive()
        wait_replicas(u, 1, timeout=120)  # idle: back to min_replicas
        r = httpx.post(u + "/v1/completions", json={"prompt": "still here", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
