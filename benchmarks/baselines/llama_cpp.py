"""llama.cpp as a baseline: built on request from the source PyPI's `llama-cpp-python` sdist
carries (vendor/llama.cpp), with its converter and quantizer for our random checkpoints.

    python -m benchmarks.baselines.llama_cpp --build              # once: ~15 min on 2 cores
    python -m benchmarks.baselines.llama_cpp --gguf llama-8b Q4_0  # a shape's GGUF, cached
    python -m benchmarks.baselines.llama_cpp --gguf llama-1b F16   # converter types directly

The build is `<cache root>/llama.cpp-<version>/` (cmake, Release, AVX512 with VNNI and BF16
but no AMX: CPU_FLAGS says why; CURL and OpenSSL off), targets llama-server and llama-quantize. A
checkpoint is converted with the sdist's convert_hf_to_gguf.py to F16, BF16 or Q8_0 (its
converter writes no 4-bit types); the others are quantized from the Q8_0 with llama-quantize
(--allow-requantize, so their weights round twice; the random weights make that moot for
speed and memory). The converter runs in our venv with the sdist's gguf-py and
sentencepiece (its import is unconditional) installed beside the build, not into our venv.
CI never builds any of this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "0.3.36"  # llama-cpp-python's sdist; its vendor/llama.cpp is what is built
TARGETS = ("llama-server", "llama-quantize")
CONVERTER_TYPES = ("F16", "BF16", "Q8_0")  # what convert_hf_to_gguf.py writes; others quantize Q8_0
# This CPU's instruction sets but AMX: built with -DGGML_NATIVE=ON, ggml's AMX matmul died
# with SIGILL on its first tile instruction here (the VM's Sapphire Rapids), while torch's
# oneDNN uses AMX in the same VM. AVX512 with VNNI and BF16 is ggml's fast path without it.
CPU_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
             "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF",
             "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def root() -> Path:
    from engine.worker.cache_paths import cache_root

    return cache_root() / f"llama.cpp-{VERSION}"


def source() -> Path:
    return root() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def binary(name: str) -> Path:
    return source() / "build" / "bin" / name


def build() -> Path:
    """Download the sdist, build the targets; -> llama-server's path. Logged as it goes."""
    top = root()
    top.mkdir(parents=True, exist_ok=True)
    if not source().exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={VERSION}", "-d", str(top)], check=True)
        with tarfile.open(top / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            tar.extractall(top, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", *CPU_FLAGS,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=source(), check=True)
    subprocess.run(["cmake", "--build", "build", "-j", str(os.cpu_count() or 1), "--target",
                    *TARGETS], cwd=source(), check=True)
    deps = top / "pydeps"
    if not (deps / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(deps),
                        "sentencepiece"], check=True)
    return binary("llama-server")


def gguf(folder: Path, kind: str) -> Path:
    """`folder` (a safetensors checkpoint) as a GGUF of `kind` (Q8_0, Q4_0, ...), cached."""
    out_dir = folder.parent / "gguf"
    out_dir.mkdir(exist_ok=True)
    target = out_dir / f"{folder.name}-{kind.lower()}.gguf"
    if target.exists():
        return target
    if kind.upper() in CONVERTER_TYPES:
        return _convert(folder, kind, target)
    q8 = out_dir / f"{folder.name}-q8_0.gguf"
    if not q8.exists():
        _convert(folder, "Q8_0", q8)
    partial = target.with_suffix(".partial")
    subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(q8), str(partial),
                    kind.upper()], check=True)
    partial.rename(target)
    return target


def _convert(folder: Path, kind: str, target: Path) -> Path:
    """llama.cpp's own converter, `folder` to `target` of a type it writes (CONVERTER_TYPES)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(source() / "gguf-py"),
                                                         str(root() / "pydeps")])}
    partial = target.with_suffix(".partial")
    subprocess.run([sys.executable, str(source() / "convert_hf_to_gguf.py"), str(folder),
                    "--outtype", kind.lower(), "--outfile", str(partial)], env=env, check=True)
    partial.rename(target)
    return target


def serve_one(model: Path, tokens: int, prompt_tokens: int = 100,
              threads: int = 2) -> dict[str, Any]:
    """Start llama-server on `model`, send one greedy request of `tokens` tokens (c=1, a
    prompt of `prompt_tokens` token ids), and report its timings and the server's memory
    (resident anonymous and file pages: llama.cpp maps its model file, so the file's pages
    are its weights)."""
    from benchmarks.common import ServerProcess

    def command(port: int) -> list[str]:
        return [str(binary("llama-server")), "-m", str(model), "-t", str(threads), "-c", "2048",
                "-np", "1", "-fa", "on", "--host", "127.0.0.1", "--port", str(port)]

    with ServerProcess("llama-server", command) as server:
        server.wait_healthy(900)
        ready = _memory(server.pid)
        body = {"prompt": list(range(1000, 1000 + prompt_tokens)), "n_predict": tokens,
                "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
        request = urllib.request.Request(f"{server.base_url}/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            timings = json.loads(response.read())["timings"]
        return {"itl_ms_p50_like": timings["predicted_per_token_ms"],
                "ttft_ms": timings["prompt_ms"], "ready": ready, "after": _memory(server.pid),
                "note": "llama.cpp's own timings: mean ms per generated token"}


def _memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="download and build llama.cpp")
    p.add_argument("--gguf", nargs=2, metavar=("SHAPE", "KIND"),
                   help="make a random shape's GGUF (benchmarks/shapes.py), e.g. llama-8b Q4_0")
    p.add_argument("--serve-one", type=Path, metavar="GGUF",
                   help="one c=1 greedy request against llama-server on this file")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    if args.build:
        print(build())
    if args.gguf:
        from benchmarks.shapes import random_model

        print(gguf(random_model(args.gguf[0]), args.gguf[1]))
    if args.serve_one:
        print(json.dumps(serve_one(args.serve_one, args.tokens), indent=1))
    if not (args.build or args.gguf or args.serve_one):
        p.print_help()


if __name__ == "__main__":
    if shutil.which("cmake") is None:
        sys.exit("llama.cpp needs cmake and a C++ compiler")
    main()
