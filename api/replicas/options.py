"""The replica flags of `pagedserve serve` and what they resolve to. No Ray import here: the
CLI reads these flags on every start, and without them Ray is never imported."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

ROUTINGS = ("prefix-aware", "power-of-two", "round-robin")
# Defaults of the autoscaler. The delays are Ray Serve's own: scale up after 30 s of load
# above target, down after 10 idle minutes (a replica reloads its model: flapping is costly).
DEFAULT_TARGET_ONGOING_REQUESTS = 16.0  # per replica: about two full decode batches on CPU
DEFAULT_UPSCALE_DELAY_S = 30.0
DEFAULT_DOWNSCALE_DELAY_S = 600.0
DEFAULT_LOOK_BACK_PERIOD_S = 30.0  # the window Ray averages ongoing requests over


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """Fixed (`num_replicas`) or autoscaled (`min_replicas`..`max_replicas`) replicas."""

    num_replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = DEFAULT_TARGET_ONGOING_REQUESTS
    upscale_delay_s: float = DEFAULT_UPSCALE_DELAY_S
    downscale_delay_s: float = DEFAULT_DOWNSCALE_DELAY_S
    look_back_period_s: float = DEFAULT_LOOK_BACK_PERIOD_S
    routing: str = "prefix-aware"
    ray_address: str | None = None  # None: start a local Ray cluster, stop it on exit

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}")
        if self.autoscaling:
            if self.num_replicas is not None:
                raise ValueError("give --num-replicas or --min/--max-replicas, not both")
            if self.min_replicas is None or self.max_replicas is None:
                raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
            if not 1 <= self.min_replicas <= self.max_replicas:
                raise ValueError("need 1 <= --min-replicas <= --max-replicas")
        elif self.num_replicas is None or self.num_replicas < 1:
            raise ValueError("--num-replicas must be >= 1")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        """The largest number of replicas this configuration may run."""
        return (self.max_replicas if self.autoscaling else self.num_replicas) or 1

    def scaling(self) -> dict[str, Any]:
        """serve.deployment keyword arguments: num_replicas, or an autoscaling_config."""
        if not self.autoscaling:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": {
            "min_replicas": self.min_replicas, "initial_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s}}


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; see docs/scaling.md)")
    g.add_argument("--num-replicas", type=_positive_int, default=None,
                   help="serve through Ray Serve with N engine replicas, each with its own "
                   "engine and KV pool (default: one process, no Ray)")
    g.add_argument("--min-replicas", type=_positive_int, default=None,
                   help="autoscale between --min-replicas and --max-replicas on ongoing "
                   "requests per replica (default: no autoscaling)")
    g.add_argument("--max-replicas", type=_positive_int, default=None,
                   help="upper bound of autoscaling (see --min-replicas)")
    g.add_argument("--target-ongoing-requests", type=_positive_float, default=None,
                   help="autoscaling target of requests in flight per replica (default: "
                   f"{DEFAULT_TARGET_ONGOING_REQUESTS:g})")
    g.add_argument("--upscale-delay", type=_non_negative_float, default=None,
                   help="seconds of load above target before a replica is added (default: "
                   f"{DEFAULT_UPSCALE_DELAY_S:g})")
    g.add_argument("--downscale-delay", type=_non_negative_float, default=None,
                   help="seconds of load below target before a replica is removed (default: "
                   f"{DEFAULT_DOWNSCALE_DELAY_S:g})")
    g.add_argument("--routing", choices=ROUTINGS, default=None,
                   help="how a request picks its replica: prefix-aware (the replica holding "
                   "the prompt's prefix, else the less loaded of two), power-of-two, "
                   "round-robin (default: prefix-aware)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 after `ray start --head`) "
                   "(default: start a local one, stopped on exit)")


REPLICA_ONLY = ("target_ongoing_requests", "upscale_delay", "downscale_delay", "routing",
                "ray_address")


def replica_options(args: argparse.Namespace) -> ReplicaOptions | None:
    """The replica configuration, or None to serve in one process (no replica flag given).
    ValueError for flags that do not fit together."""
    counts = (args.num_replicas, args.min_replicas, args.max_replicas)
    if all(c is None for c in counts):
        given = [f"--{n.replace('_', '-')}" for n in REPLICA_ONLY if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --num-replicas or --min/--max-replicas")
        return None
    extra = {k: v for k, v in (
        ("target_ongoing_requests", args.target_ongoing_requests),
        ("upscale_delay_s", args.upscale_delay), ("downscale_delay_s", args.downscale_delay),
        ("routing", args.routing), ("ray_address", args.ray_address)) if v is not None}
    return ReplicaOptions(num_replicas=args.num_replicas,
                          min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                          **extra)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value
