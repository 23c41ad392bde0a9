"""Our C++ CPU kernels, built on first use with the machine's g++ and cached.

Two libraries, one per source, built and loaded by `load_library`:
- paged decode attention (csrc/paged_decode.cpp), which reads each decode's K/V straight from
  the paged pool instead of gathering a padded copy (engine/attention/paged.py). Every step
  calls its fused form, paged_decode_step: the layer's K/V writes and its decodes' attention
  in one op call (prompt chunks then go through SDPA). It is optional: without a compiler, or
  if the build fails, the engine logs why once and keeps the torch path, which gives the same
  results (tests/engine/test_cpu_kernels.py).
- the quantized linears' many-row matmuls (engine/layers/quantization/csrc/quant_mm.cpp),
  used by engine/layers/quantization/linear.py.

Build. g++ (-O3 -march=native -fopenmp; compile, then link) against torch's headers and
libraries, 7-8 s, no ninja and no Python headers: the .so registers its ops with TORCH_LIBRARY and
is loaded by torch.ops.load_library. OpenMP: the .so links libgomp.so.1, which resolves to
the copy torch has already loaded, so the kernel shares torch's thread pool (at::parallel_for
and torch.set_num_threads apply). The cache key covers the source, the flags, torch's version
and ABI, and the CPU's model and flags (-march=native code must not run on another CPU), so
a cache folder shared across machines or upgrades never loads a stale build.

`--attention-backend torch` (EngineConfig.attention_backend) turns it off; auto, the default,
uses it on the CPU whenever it builds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
                 "-fPIC", "-std=c++20")
LINK_FLAGS = ("-shared", "-fopenmp")
# -ffast-math lets exp and the dot products' sums vectorise (within 1e-5 of the torch path in
# fp32, tests/engine/test_cpu_kernels.py). It is a compile flag only: linked with it, GCC adds
# crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process when the library loads (that broke hypothesis' float strategies in our own tests).
# So compiling and linking are two g++ calls, and a test checks that subnormals survive.


def wants_paged_decode(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decodes should use the kernel: asked for (backend auto), a CPU, a dtype it
    has (fp32, bf16), and the library built."""
    return (backend == "auto" and device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16) and paged_decode_available())


def paged_decode_available() -> bool:
    return _load() is not None


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [D, H, hd]; pools [blocks, kvH, block_size, hd]; tables [D, W] and lens [D] int64
    -> [D, H, hd]; window: each query sees its last `window` positions (0: all); softcap:
    scores become softcap * tanh(score / softcap) (0: unchanged); sinks: [H] float32 logits
    one more in each head's softmax sum (gpt-oss). Only after
    paged_decode_available() returned True."""
    return torch.ops.pagedserve_cpu.paged_decode(q, k_pool, v_pool, tables, lens, scale, window,
                                                 softcap, sinks)


# The libraries this process has loaded, by source. Their ops register once per process (a
# second copy, say from another cache folder, would abort on the duplicate registration).
_loaded: dict[Path, Path] = {}


def _load() -> Path | None:
    return load_library(SOURCE, "paged-decode kernel", "the torch path")


@functools.cache
def load_library(source: Path, what: str, fallback: str) -> Path | None:
    """Build (or find) the library of one of our C++ sources and load it into torch; None,
    logged once (`what` is unavailable, `fallback` is used instead), if that fails."""
    if source not in _loaded:
        try:
            library = _build(source, what)
            torch.ops.load_library(str(library))
        except Exception as exc:  # noqa: BLE001 - any failure means: keep the fallback
            log.warning("CPU %s unavailable, using %s: %s", what, fallback, exc)
            return None
        _loaded[source] = library
    return _loaded[source]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    return cxx


def _commands(cxx: str, source: Path, output: Path) -> list[list[str]]:
    """Compile `source` to an object beside `output`, then link that into `output`."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    obj = output.with_suffix(".o")
    return [[cxx, *COMPILE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             *[f"-I{p}" for p in include_paths()], "-c", str(source), "-o", str(obj)],
            [cxx, *LINK_FLAGS, str(obj), "-o", str(output),
             *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu",
             *[f"-Wl,-rpath,{p}" for p in library_paths()]]]


def _cache_key(cxx: str, text: bytes) -> str:
    parts = [text, " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), torch.__version__.encode(),
             str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), cxx.encode(), _cpu_id().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_id() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(source: Path, what: str) -> Path:
    from engine.worker.cache_paths import cache_root

    cxx = _compiler()
    folder = cache_root() / "cpu_kernels"
    text = source.read_bytes()  # read once: the key and the build are of the same text
    library = folder / f"{source.stem}-{_cache_key(cxx, text)}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log.info("building the CPU %s (once per machine and torch version)", what)
    # Built beside its final name and renamed into place: processes building at once (tests,
    # replicas) each finish a whole file, and none loads a half-written one.
    # The source compiled is a copy of the bytes hashed: a checkout edited during a build
    # must not leave a library under one text's key that holds another's code.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        partial = Path(tmp) / library.name
        copy = Path(tmp) / source.name
        copy.write_bytes(text)
        for command in _commands(cxx, copy, partial):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({done.returncode}): "
                                   f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    log.info("built the CPU %s in %.1f s: %s", what, time.perf_counter() - started, library)
    return library
