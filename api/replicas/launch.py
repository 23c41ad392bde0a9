"""Build the Ray Serve application (ingress + engine deployments) and run it for
`pagedserve serve --num-replicas N` (or --min/--max-replicas).

By default a local Ray cluster is started (small: no dashboard; every Ray process listening
on 127.0.0.1 only, engine/replicas/loopback.py) and stopped on exit;
`--ray-address` joins an existing one and only removes the application on exit. SIGTERM or
SIGINT shuts Serve down gracefully: requests in flight get --shutdown-timeout seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from api.replicas.ingress import Ingress
from api.replicas.options import ReplicaOptions
from api.replicas.router import router_class
from engine.config import EngineConfig
from engine.replicas.board import create_board
from engine.replicas.deployment import EngineReplica
from engine.replicas.loopback import use_loopback_cluster

logger = logging.getLogger("pagedserve")

APP_NAME = "pagedserve"
UNBOUNDED_ONGOING = 100_000  # the engine's queue is unbounded: so is the replica's
INGRESS_ONGOING = 100_000  # the ingress only relays; its limit is --limit-concurrency's job
HEALTH_CHECK_PERIOD_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything the application is built from, besides the engine config."""

    replicas: ReplicaOptions
    app_options: dict[str, Any]  # create_app's keyword arguments for the ingress
    shutdown_timeout: float = 25.0
    num_gpus_per_replica: float = 0.0
    host: str = "127.0.0.1"
    port: int = 8000


def settings_from_args(args: argparse.Namespace, replicas: ReplicaOptions) -> ServeSettings:
    """The serve flags the ingress's app and the deployments take."""
    app_options = {"api_key": args.api_key, "max_body_bytes": args.max_body_bytes,
                   "request_timeout": args.request_timeout,
                   "trust_request_chat_template": args.trust_request_chat_template,
                   "metrics_prefix": args.metrics_prefix, "enable_ui": not args.disable_ui}
    return ServeSettings(replicas, app_options, args.shutdown_timeout, host=args.host,
                         port=args.port)


def build_app(config: EngineConfig, settings: ServeSettings, board: Any) -> Any:
    """The Serve application: the ingress, bound to the engine deployment's handle."""
    opts = settings.replicas
    engine = serve.deployment(
        name="engine", **opts.scaling(),
        max_ongoing_requests=engine_ongoing_limit(config),
        ray_actor_options={"num_cpus": config.num_threads or 1,
                           "num_gpus": settings.num_gpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class=router_class(opts.routing),  # type: ignore[arg-type]
            request_router_kwargs=router_kwargs(opts.routing, config)),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
    )(EngineReplica).bind(config, board)
    ingress = serve.deployment(
        name="ingress", num_replicas=1, max_ongoing_requests=INGRESS_ONGOING,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=settings.shutdown_timeout)(Ingress)
    return ingress.bind(engine, board, settings.app_options)


def engine_ongoing_limit(config: EngineConfig) -> int:
    """Requests Serve may send one replica: its batch plus its queue bound, plus one so the
    engine (not Serve) refuses the next with a 429 and Retry-After."""
    s = config.scheduler
    if s.max_num_queued_reqs <= 0:
        return UNBOUNDED_ONGOING
    return s.max_num_seqs + s.max_num_queued_reqs + 1


def router_kwargs(routing: str, config: EngineConfig) -> dict[str, Any]:
    return {"block_size": config.scheduler.block_size} if routing == "prefix-aware" else {}


def replica_config(config: EngineConfig, replicas: ReplicaOptions,
                   cores: int) -> EngineConfig:
    """Torch threads per replica when not given: the cores shared by the most replicas."""
    if config.num_threads is not None:
        return config
    return dataclasses.replace(config, num_threads=max(1, cores // replicas.most_replicas))


def start_ray(replicas: ReplicaOptions, config: EngineConfig) -> None:
    if replicas.ray_address is not None:
        ray.init(address=replicas.ray_address, include_dashboard=False)
        return
    # Logical CPUs: enough for every replica's threads even on a small machine.
    cpus = max(os.cpu_count() or 1, replicas.most_replicas * (config.num_threads or 1))
    use_loopback_cluster()  # no Ray port of ours is reachable from another machine
    ray.init(num_cpus=cpus, include_dashboard=False)


def gpus_per_replica(config: EngineConfig) -> float:
    """One GPU per replica when the engine runs on CUDA and the cluster has GPUs."""
    on_cuda = config.device == "auto" or config.device.startswith("cuda")
    return 1.0 if on_cuda and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def run(config: EngineConfig, settings: ServeSettings) -> None:
    """Deploy, serve until SIGTERM/SIGINT, drain, shut down (and leave no Ray process behind
    when the cluster was ours)."""
    config = replica_config(config, settings.replicas, os.cpu_count() or 1)
    start_ray(settings.replicas, config)
    stop = threading.Event()
    # Right after ray.init, whose own SIGTERM handler aborts the process; a signal during
    # start-up is then served once the app is up (drained at once).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        settings = dataclasses.replace(settings, num_gpus_per_replica=gpus_per_replica(config))
        serve.start(http_options={"host": settings.host, "port": settings.port})
        app = build_app(config, settings, create_board())
        ingress = serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info("serving at http://%s:%d/v1 through Ray Serve (%s)", settings.host,
                    settings.port, describe(settings.replicas))
        stop.wait()
        logger.info("draining: requests in flight get up to %.0f s", settings.shutdown_timeout)
        cut = ingress.drain.remote(settings.shutdown_timeout).result(
            timeout_s=settings.shutdown_timeout + 30)
        logger.info("drained (%d request(s) cut); stopping Ray Serve", cut)
    finally:
        stop_serving(settings.replicas)


def stop_serving(replicas: ReplicaOptions) -> None:
    try:
        if replicas.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()  # a local cluster (ours) stops with it


def describe(replicas: ReplicaOptions) -> str:
    scale = (f"{replicas.min_replicas}-{replicas.max_replicas} replicas, autoscaling"
             if replicas.autoscaling else f"{replicas.num_replicas} replicas")
    return f"{scale}, {replicas.routing} routing"
