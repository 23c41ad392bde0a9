"""Model resolution, loading, dtype/device choice and the GGUF conversion cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.worker import loader
from engine.worker.cache_paths import cache_root, gguf_cache_dir
from engine.worker.loader import (
    converted_gguf,
    embedded_gguf,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_source,
)


def test_loads_a_checkpoint_folder(tiny_llama: Path) -> None:
    m = load_model(str(tiny_llama), device="cpu", dtype="float32")
    f = m.facts
    assert (f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim) == (2, 4, 2, 16)
    assert f.vocab_size == len(m.tokenizer)
    assert f.max_position_embeddings == 512
    assert f.eos_token_ids == frozenset({1})
    assert f.display_name == tiny_llama.name
    assert not m.model.training and m.model.dtype == torch.float32


def test_dtype_is_applied(tiny_qwen2: Path) -> None:
    m = load_model(str(tiny_qwen2), device="cpu", dtype="bfloat16")
    assert m.model.dtype == torch.bfloat16


def test_missing_path_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_source(str(missing))
    with pytest.raises(FileNotFoundError, match="someone/not-cached"):
        resolve_source("someone/not-cached")


def test_folder_without_config_and_wrong_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_source(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_source(str(other))


def test_embedded_model_is_found() -> None:
    path, name = resolve_source(None)
    assert path == embedded_gguf() and path.suffix == ".gguf" and path.is_file()
    assert name == "SmolLM2-135M-Instruct"


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"


def test_broken_gguf_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="broken.gguf"):
        converted_gguf(bad)
    assert not gguf_cache_dir(bad).exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the temp dir was removed too


def test_gguf_cache_is_keyed_by_content(monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    """A reinstall rewrites the same file with a new mtime: same cache. New bytes: new cache."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF same bytes")
    os.utime(b, ns=(10**18, 10**18))
    assert gguf_cache_dir(a) == gguf_cache_dir(b)
    assert gguf_cache_dir(a).parent == tmp_path / "cache" and gguf_cache_dir(a).name.startswith("m-")
    b.write_bytes(b"GGUF other bytes")
    os.utime(b, ns=(2 * 10**18, 2 * 10**18))
    assert gguf_cache_dir(a) != gguf_cache_dir(b)


def test_auto_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16


def test_native_bf16_follows_cpuinfo() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert loader.cpu_has_native_bf16()


@pytest.mark.slow
def test_gguf_is_converted_once_then_reused(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    gguf = embedded_gguf()
    folder = converted_gguf(gguf)
    assert folder == gguf_cache_dir(gguf) and folder.parent == tmp_path
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                     folder.iterdir()}
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    m = load_model(None, device="cpu", dtype="float32")
    # A reload, not a second conversion: the converted file is the same one, untouched (a
    # wall-clock bound here would fail on a slow, shared machine).
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    f = m.facts
    assert (f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim, f.vocab_size) == (
        30, 9, 3, 64, 49152)
    assert f.eos_token_ids == frozenset({2}) and f.max_position_embeddings == 8192
