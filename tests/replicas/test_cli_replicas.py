"""`pagedserve serve --num-replicas 1` as a user runs it: a local Ray cluster of its own,
every port of it on the loopback address, serving through Serve's proxy; SIGTERM lets a request in flight finish, then the process
exits and leaves no Ray process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.support.ray_serve import (
    free_port,
    is_loopback,
    listening_addresses,
    process_tree,
    ray_processes,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_and_leaves_no_ray_process(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "api", "serve", "--config", "tiny", "--model", str(tiny_model),
         "--served-model-name", "tiny", "--num-threads", "1", "--num-replicas", "1",
         "--port", str(port), "--shutdown-timeout", "20", "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, timeout=300)
        # Issue 38: Ray takes no authentication, so none of its ports may face the network.
        ours = process_tree(proc.pid).union(*(process_tree(p) for p in ray_processes(proc.pid)))
        listening = listening_addresses(ours)
        assert any(a.startswith(f"127.0.0.1:{port} ") for a in listening), listening
        assert [a for a in listening if not is_loopback(a.split(" ")[0])] == [], listening
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "drain me", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # drained
    deadline = time.monotonic() + 30
    while ray_processes(proc.pid) and time.monotonic() < deadline:  # the CLI was the driver
        time.sleep(0.2)
    assert not ray_processes(proc.pid), (tmp_path / "serve.log").read_text()[-2000:]
