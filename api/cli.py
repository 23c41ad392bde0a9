"""`pagedserve serve ...`: build the engine from a TOML preset plus flags, serve it with uvicorn.

Flags are named like vLLM's. Engine flags default to None, meaning "whatever the --config
preset says" (and the built-in default where the preset is silent); the engine is imported
inside main() so that importing api.* never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from api.connections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    ConnectionLimits,
    uvicorn_config,
)
from api.metrics import DEFAULT_PREFIX, check_prefix
from api.replicas.options import ReplicaOptions, add_replica_flags, replica_options
from api.server import DEFAULT_SHUTDOWN_TIMEOUT_S, GracefulServer
from api.state import DEFAULT_MAX_BODY_BYTES
from engine.config import EngineConfig, read_config_file
from scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from engine.client.async_engine import AsyncEngine
    from engine.client.core_client import EngineCoreClient

logger = logging.getLogger("pagedserve")

# After the drain and the engine's own shutdown wait (STOP_WAIT_S), the step loop may take
# this much longer to return before the step counts as hung: 25 + 3 + 1 s, within
# Kubernetes' default 30 s grace.
HUNG_STEP_GRACE_S = 1.0

# The engine's and the scheduler's settings that are flags: generated from their dataclass
# fields (scheduler/config.py's option(): one place holds each default and its help).
CONFIG_CLASSES = (EngineConfig, SchedulerConfig)


def config_fields() -> list[dataclasses.Field[Any]]:
    return [f for cls in CONFIG_CLASSES for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata["flag"] or "--" + f.name.replace("_", "-"))


# flag -> the EngineConfig / SchedulerConfig field it sets
ENGINE_FLAGS: dict[str, str] = {flag_name(f): f.name for f in config_fields()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="OpenAI-compatible LLM server: continuous batching "
        "over a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve}")
    serve = sub.add_parser("serve", help="serve a model over HTTP (run `pagedserve serve --help`)",
                           description="Serve a model with the OpenAI API (/v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /metrics).")
    _add_serve_flags(serve)
    # `pagedserve --help` shows the serve flags too: there is only one subcommand.
    parser.epilog = serve.format_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="default",
                   help="TOML preset name in configs/ or a path; flags override it "
                   "(default: default)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health, "
                   "/metrics and the built-in pages' static files (default: none)")
    p.add_argument("--disable-ui", action="store_true",
                   help="do not serve the playground (/), the live view (/dashboard) or its "
                   "event stream (/v1/engine/events)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="logging verbosity of the server and engine (default: info)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--request-timeout", type=_positive_float, default=None,
                   help="seconds a request may take from arrival: still queued then, it fails "
                   "with 503; already generating, it ends with what it has and "
                   "finish_reason \"timeout\"; a request's own `timeout` field can only "
                   "shorten it (default: no limit)")
    p.add_argument("--shutdown-timeout", type=_positive_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish while new "
                   "ones get 503; the rest then end with an error (default: "
                   f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a Jinja chat_template in requests (as vLLM's flag: off by "
                   "default, since a template runs on the server and can be made slow)")
    p.add_argument("--engine-core", choices=["thread", "process"], default="thread",
                   help="where the step loop (scheduler, model runner, detokenizer) runs: "
                   "`thread`, in this process beside the HTTP server; `process`, in a child "
                   "process of its own (vLLM v1's EngineCore; messages over a pipe with "
                   "msgspec), so the API's work does not share the interpreter lock with the "
                   "steps. Measurements: docs/engine-core.md (default: thread)")
    _add_connection_flags(p)
    p.add_argument("--metrics-prefix", type=_metrics_prefix, default=DEFAULT_PREFIX,
                   help="prefix of every /metrics name before the ':'; `vllm` gives vLLM's "
                   "names (vllm:num_requests_running ...) so its dashboards and autoscaling "
                   f"rules work unchanged (default: {DEFAULT_PREFIX})")
    preset = read_config_file("default")
    preset_values = {**preset.get("engine", {}), **preset.get("scheduler", {})}
    for f in config_fields():
        _add_config_flag(p, f, preset_values)
    add_replica_flags(p)


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit-concurrency", type=_non_negative_int, default=DEFAULT_LIMIT_CONCURRENCY,
                   help="requests in progress past which a new one gets a JSON 503 with "
                   "Retry-After (idle connections do not count; /health and /metrics are "
                   f"exempt); 0 = no limit (default: {DEFAULT_LIMIT_CONCURRENCY})")
    p.add_argument("--timeout-keep-alive", type=_positive_float,
                   default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open, as uvicorn's "
                   f"(default: {DEFAULT_TIMEOUT_KEEP_ALIVE_S:g})")
    p.add_argument("--timeout-header", type=_positive_float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a client has from its first byte to the end of the request "
                   "headers; then the connection is closed (default: "
                   f"{DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--timeout-body", type=_positive_float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a client has from the end of the headers to the end of the "
                   "body (in all, not per read); then it gets 408 and the connection is closed "
                   f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(limit_concurrency=args.limit_concurrency or None,
                            timeout_keep_alive=args.timeout_keep_alive,
                            header_timeout=args.timeout_header, body_timeout=args.timeout_body)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _metrics_prefix(text: str) -> str:
    try:
        return check_prefix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _add_config_flag(p: argparse.ArgumentParser, f: dataclasses.Field[Any],
                     preset_values: dict[str, Any]) -> None:
    """A flag for a config field. Its default is None, "whatever --config says", so the help
    names the default preset's value where it sets one, else the field's own default."""
    meta = f.metadata
    default = _shown(f.default, meta["default_text"])
    if f.name in preset_values and preset_values[f.name] != f.default:
        default = f"{_shown(preset_values[f.name])} in the default preset, else {default}"
    help_ = f"{meta['help']} (default: {default})"
    if f.default is True or f.default is False:
        p.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, default=None,
                       help=help_)
        return
    kind = meta["kind"] or type(f.default)
    p.add_argument(flag_name(f), type=kind, default=None, help=help_, choices=meta["choices"])


def _shown(value: Any, text_for_none: str | None = None) -> str:
    if value is None:
        return str(text_for_none)
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, as EngineConfig/SchedulerConfig fields."""
    overrides = {field: getattr(args, flag[2:].replace("-", "_"))
                 for flag, field in ENGINE_FLAGS.items()}
    return {k: v for k, v in overrides.items() if v is not None}


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        replicas = replica_options(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if replicas is not None:
        serve_replicas(args, replicas)
    else:
        serve(args)


def serve_replicas(args: argparse.Namespace, replicas: ReplicaOptions) -> None:
    """The same API as a Ray Serve application (api/replicas/): Ray loads only here."""
    from api.replicas.launch import run, settings_from_args
    from engine.config import load_config

    run(load_config(args.config, **config_overrides(args)), settings_from_args(args, replicas))


def serving_threads() -> int:
    """All usable cores. The step loop runs on the main thread (see
    AsyncEngine.run_step_loop), where 2 torch threads gave 92 output tok/s against 60 for
    1 on the 2-core box (16 streams, prompts 32-512, bf16). With the loop on a thread of its
    own, 1 thread had been the better choice (2 gave 57)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_model_source(model: str | None) -> None:
    """A model that is not there, or of a family we do not serve, is one line and a non-zero
    exit before the server starts (not a background load failure behind 503s)."""
    from engine.worker.families import UnsupportedModelError, check_supported
    from engine.worker.loader import resolve_source

    try:
        source, _ = resolve_source(model)
        check_supported(source)
    except (FileNotFoundError, UnsupportedModelError, ValueError) as e:
        raise SystemExit(f"pagedserve: error: {e}") from None


def serve(args: argparse.Namespace) -> None:
    from api.app import create_app
    from api.state import AppState
    from engine.client.async_engine import AsyncEngine  # torch loads here, not at import
    from engine.client.core_client import EngineCoreClient
    from engine.config import load_config, missing_default_model

    config = load_config(args.config, **config_overrides(args))
    if (missing := missing_default_model(config)) is not None:
        raise SystemExit(f"pagedserve: error: {missing}")
    check_model_source(config.model)
    if config.num_threads is None:
        config = dataclasses.replace(config, num_threads=serving_threads())
    engine: AsyncEngine | EngineCoreClient = (
        EngineCoreClient(config) if args.engine_core == "process" else AsyncEngine(config))
    app = create_app(engine, served_model_name=engine.model_name, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                     trust_request_chat_template=args.trust_request_chat_template,
                     metrics_prefix=args.metrics_prefix, enable_ui=not args.disable_ui)
    logger.info("serving %s at http://%s:%d/v1 (loading the model in the background; "
                "/health answers 200 once ready)", engine.model_name, args.host, args.port)
    http = uvicorn_config(app, args.host, args.port, args.log_level, connection_limits(args))
    server = GracefulServer(http, AppState.of_app(app).lifecycle, args.shutdown_timeout)
    # Signals reach the main thread, which hands them to the HTTP server.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    run_serving(engine, server, exit_if_hung=True)


def run_serving(engine: AsyncEngine | EngineCoreClient, server: GracefulServer,
                exit_if_hung: bool = False) -> None:
    """HTTP on a thread of its own, the engine's step loop on the calling thread (see
    AsyncEngine.run_step_loop; with --engine-core process the steps run in the core process
    and the calling thread only waits), until the server stops. The CLI calls it from the main
    thread; tests call it from a thread they start, so both run the same path.

    `exit_if_hung` (the CLI): once the server has drained and stopped, a step that still has
    not returned after HUNG_STEP_GRACE_S is hung (nothing can interrupt it: it is in torch's
    C++ on the main thread), and the process exits at once with status 1 instead of outliving
    the orchestrator's grace period (Kubernetes kills at 30 s; the drain takes 25)."""
    def serve_http() -> None:
        try:
            server.run()
        finally:  # also when it could not start (port taken): the engine must not outlive it
            engine.request_stop()
        if exit_if_hung and not loop_returned.wait(HUNG_STEP_GRACE_S):
            logger.error("the engine's step did not return within %.0f s of shutdown: it is "
                         "hung; exiting now", HUNG_STEP_GRACE_S)
            logging.shutdown()
            os._exit(1)

    loop_returned = threading.Event()
    thread = threading.Thread(target=serve_http, name="pagedserve-http")
    thread.start()
    try:
        engine.run_step_loop()  # returns once the server's shutdown has stopped the engine
    finally:
        loop_returned.set()
    thread.join()
