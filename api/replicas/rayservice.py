"""The KubeRay RayService's entry point (deploy/rayservice.yaml's `import_path`):
`pagedserve serve`'s flags from $PAGEDSERVE_ARGS, the application from
api/replicas/launch.py. A module of its own because it composes the CLI's flag parsing with
the launcher, which the CLI itself imports: in either of them it made an import circle."""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

from api.cli import build_parser, config_overrides
from api.replicas.launch import (
    APP_NAME,
    build_app,
    create_board,
    gpus_per_replica,
    settings_from_args,
)
from api.replicas.options import ReplicaOptions, replica_options
from engine.config import load_config


def app_from_env(_: dict[str, str] | None = None) -> Any:
    """An application builder for a Serve config's `import_path`: the cluster and the HTTP
    proxy come from the RayService. The board is a named detached actor: the task that runs
    this builder ends, the application lives on."""
    args = build_parser().parse_args(["serve", *shlex.split(os.environ.get("PAGEDSERVE_ARGS",
                                                                          ""))])
    replicas = replica_options(args) or ReplicaOptions(num_replicas=1)
    config = load_config(args.config, **config_overrides(args))
    settings = dataclasses.replace(settings_from_args(args, replicas),
                                   num_gpus_per_replica=gpus_per_replica(config))
    return build_app(config, settings, create_board(detached_name=f"{APP_NAME}-board"))
