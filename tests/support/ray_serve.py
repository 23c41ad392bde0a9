"""A Ray Serve deployment of pagedserve for tests: a small local Ray cluster (no dashboard,
few logical CPUs), Serve's HTTP proxy on a free loopback port, the app built exactly as the
CLI builds it (api.replicas.launch.build_app), and a teardown that leaves no Ray process.

One cluster per test module (a module fixture): starting Ray costs seconds on 2 cores; apps
are deployed and deleted on it as tests need.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import ray
from ray import serve

from api.replicas.launch import APP_NAME, ServeSettings, build_app
from api.replicas.options import ReplicaOptions
from engine.config import EngineConfig
from engine.replicas.board import create_board

METRIC = re.compile(r'^(pagedserve:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+|NaN)$')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RayCluster:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def ray_cluster(num_cpus: int = 4) -> Iterator[RayCluster]:
    """A local Ray cluster with Serve's proxy on a free port; everything stopped after."""
    port = free_port()
    # Replicas and handles push autoscaling metrics every 0.25 s (Ray's default: 10 s), so
    # the autoscaling test sees a burst within its short look-back window.
    push = "0.25"
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {
                 "OMP_NUM_THREADS": "1",
                 "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": push,
                 "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": push}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield RayCluster(port)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@contextmanager
def deployed(cluster: RayCluster, config: EngineConfig, replicas: ReplicaOptions,
             **app_options: Any) -> Iterator[str]:
    """Deploy the app (waits until every replica has loaded), yield its base URL, delete it."""
    settings = ServeSettings(replicas, app_options, shutdown_timeout=5.0)
    serve.run(build_app(config, settings, create_board()), name=APP_NAME, route_prefix="/")
    try:
        wait_healthy(cluster.url)
        yield cluster.url
    finally:
        serve.delete(APP_NAME)


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the Ray Serve app did not become healthy")


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """{metric name: {replica id: value}} for the engine series of /metrics."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = METRIC.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if "replica" in labels:
            out.setdefault(m.group(1), {})[labels["replica"]] = float(m.group(3))
    return out


def ray_processes(driver: int) -> list[int]:
    """Pids of the raylet / gcs_server processes of the Ray cluster that process `driver`
    started (leftovers after a test). Ray names a session session_<time>_<driver pid> and
    passes its folder to both on their command line; other clusters on the machine (another
    test run) are not ours to count."""
    mark = f"_{driver}/".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if cmd[0].endswith((b"raylet", b"gcs_server")) and any(mark in a for a in cmd[1:]):
            pids.append(int(pid))
    return pids


def process_tree(root: int) -> set[int]:
    """root and every process below it (from each process's parent pid in /proc)."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])  # comm may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    tree: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def listening_addresses(pids: set[int]) -> list[str]:
    """'address:port (pid)' of every TCP socket these processes listen on, IPv4 and IPv6
    (from /proc/net/tcp{,6} and each process's file descriptors)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue  # gone, or not ours to read
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(f"{_proc_net_address(fields[1])} ({inodes[fields[9]]})")
    return found


def _proc_net_address(hex_address: str) -> str:
    """/proc/net/tcp's 'IP:PORT' in hex (the IP in 32-bit words of host byte order)."""
    ip_hex, port_hex = hex_address.split(":")
    raw = b"".join(bytes.fromhex(ip_hex[i:i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    return f"{ipaddress.ip_address(raw)}:{int(port_hex, 16)}"


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
