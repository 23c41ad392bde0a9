"""A local Ray cluster that only this machine can reach (`--num-replicas` without
`--ray-address`).

Ray's processes (GCS, raylet, the dashboard and runtime-env agents, every worker) take no
authentication: whoever reaches their ports can run code in the cluster. Ray binds their gRPC
servers to all interfaces unless the node's IP is 127.0.0.1, and `ray.init` turns a loopback
node IP back into the host's routable address unless it believes clusters are off, which
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 says on Linux too (Ray reads it into
`ray_constants.ENABLE_RAY_CLUSTER` at import, and looks the attribute up when it picks the
node IP). Ray Serve's replicas also start an inter-deployment gRPC server on "[::]:0" whatever
the node IP; each of our deployments rebinds it to 127.0.0.1 from its constructor, which Serve
runs before it starts that server. tests/replicas/test_cli_replicas.py checks that no
listening socket of the process tree is on another address.
"""

from __future__ import annotations

import os
from typing import Any

ENV_FLAG = "PAGEDSERVE_RAY_LOOPBACK"  # set for the cluster's processes: they inherit it
LOOPBACK = "127.0.0.1"


def use_loopback_cluster() -> None:
    """Before `ray.init` starts a local cluster: its node IP, and so every bind, is loopback."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ[ENV_FLAG] = "1"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # already imported: the env var came too late


def keep_replica_on_loopback() -> None:
    """In a deployment's constructor, on a loopback cluster: Serve's inter-deployment gRPC
    server (bound to "[::]:0" by Serve itself) listens on 127.0.0.1 instead."""
    if os.environ.get(ENV_FLAG) != "1":
        return
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "on_loopback", False):
        return

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return int(bind(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0") else address))

    on_loopback.on_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_loopback
