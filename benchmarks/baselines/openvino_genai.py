"""OpenVINO GenAI as a baseline server: its continuous-batching pipeline (paged KV cache,
iteration-level scheduler) behind the baselines' own `/v1/completions` protocol.

OpenVINO ships no OpenAI server in its pip packages (its model server is a separate C++
product), so this is the thin wrapper issue 32 asks for: the pipeline's own loop
(`add_request`, `step`, `GenerationHandle.read`) runs in a process of its own, and each
step's new tokens are handed to the request's stream on the HTTP process's event loop, the
way OpenVINO's model server drives the same pipeline. What the wrapper adds per token (a
pipe message a step, a queue hand-over, an incremental detokenize) is what our other Python
baselines pay too.

Made only on request, never in CI, in a venv of its own (openvino pins nothing of ours, but
optimum-intel's export pulls a torch and a transformers of its own):

    python -m benchmarks.baselines.openvino_genai --make-venv
    python -m benchmarks.baselines.openvino_genai --export llama-1b int4   # IR, cached

The IR is exported with optimum-intel (`optimum-cli export openvino`, NNCF weight
compression: int8 per channel, or int4 in groups of 128 with int8 for the embeddings and the
head, NNCF's defaults). The pipeline runs with the CPU plugin's defaults, which are what its
users get: bf16 inference, activations quantized to int8 on the fly in groups of 32 for the
compressed weights (DYNAMIC_QUANTIZATION_GROUP_SIZE), and a u8 KV cache
(KV_CACHE_PRECISION); its scheduler's defaults too (dynamic split-fuse, 256 batched tokens a
step), but a 2 GB KV pool and no prefix caching. The server is started with the venv's python:

    <venv>/bin/python -m benchmarks.baselines.openvino_genai --serve IR --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.baselines import venvs

VERSION = "2026.4.1"
PACKAGES = (f"openvino=={VERSION}", f"openvino-genai=={VERSION}.0",
            f"openvino-tokenizers=={VERSION}.0", "optimum-intel[openvino]", "nncf",
            "starlette", "uvicorn")
# optimum-intel needs a torch for the export: the CPU wheel, or pip pulls a CUDA build.
TORCH = "torch==2.13.0+cpu"
WEIGHT_FORMATS = {"int8": ["--weight-format", "int8"],
                  "int4": ["--weight-format", "int4", "--group-size", "128", "--ratio", "1.0"]}
KV_CACHE_GB = 2  # the pipeline's paged KV pool: plenty for 16 streams of ~230 tokens at 1B
SERVED_NAME = "openvino"


def venv_dir() -> Path:
    return venvs.venv_dir("PAGEDSERVE_OPENVINO_VENV", f"openvino-{VERSION}")


def venv_python(venv: Path | None = None) -> Path:
    return venvs.python_of(venv or venv_dir())


def installed(venv: Path | None = None) -> bool:
    """True when the venv's python finds openvino_genai (cheap: nothing is imported)."""
    return venvs.has_module(venv or venv_dir(), "openvino_genai")


def make_venv(venv: Path | None = None, python: str = sys.executable) -> Path:
    """Create the venv and install OpenVINO GenAI and optimum-intel into it (minutes)."""
    venv = venv or venv_dir()
    if installed(venv):
        print(f"OpenVINO venv already there: {venv}", flush=True)
        return venv
    print(f"making the OpenVINO venv {venv} ({', '.join(PACKAGES)})", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", TORCH, *PACKAGES], check=True)
    # pip pulls a torchvision built for another torch; its import then breaks transformers'
    # (and so the export's), and nothing here needs it.
    subprocess.run([*pip, "uninstall", "-y", "torchvision"], check=True)
    return venv


def export(folder: Path, weight_format: str) -> Path:
    """`folder` (a safetensors checkpoint) as an OpenVINO IR with `weight_format` weights,
    cached beside the benchmark models."""
    out = folder.parent / "openvino" / f"{folder.name}-{weight_format}"
    if (out / "openvino_model.xml").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    cli = venv_python().parent / "optimum-cli"
    subprocess.run([str(cli), "export", "openvino", "--model", str(folder), "--task",
                    "text-generation-with-past", *WEIGHT_FORMATS[weight_format], str(partial)],
                   check=True)
    partial.rename(out)
    return out


def weight_bytes(ir: Path) -> int:
    """What one decode step reads of weights: the IR's weight file (every tensor is read
    once a step; the embedding is tied to the head, which reads all of it)."""
    return (ir / "openvino_model.bin").stat().st_size


def argv(ir: Path, port: int) -> list[str]:
    """The venv's python serving `ir` (the repo on PYTHONPATH: benchmarks/ is not installed)."""
    root = Path(__file__).resolve().parents[2]
    return ["env", f"PYTHONPATH={root}", str(venv_python()), "-m",
            "benchmarks.baselines.openvino_genai", "--serve", str(ir), "--host", "127.0.0.1",
            "--port", str(port)]


# --- the server (runs in the OpenVINO venv) ---
#
# Two processes: the pipeline steps in a child of its own, as vLLM's engine core does, and
# the two exchange one message a step over a pipe. `step()` does release the GIL (a Python
# thread beside it kept running), so a thread would do too; the process keeps the pipeline's
# own threads and allocator away from the event loop, and a pipeline crash from the HTTP
# side. (The bursts first seen here, ITL p50 0 ms and p99 1.9 s at 16 streams, came from the
# client protocol's prompt check calling `len(tokenizer)`, ~6 ms, once per prompt token;
# protocol.py now calls it once.)
#
# Messages to the pipeline: ("add", rid, prompt ids, max tokens, ignore_eos), ("cancel", rid),
# None (stop). From it, after every step: [(rid, new token ids, done), ...].


class PipelineLoop:
    """The pipeline's step loop (the child process): requests in, each step's tokens out.

    `pipe`: a ContinuousBatchingPipeline; `genai`: the openvino_genai module (its
    GenerationConfig and GenerationStatus); `tensor`: prompt ids -> the pipeline's input;
    `conn`: this end of the pipe."""

    def __init__(self, pipe: Any, genai: Any, tensor: Callable[[list[int]], Any],
                 conn: Any) -> None:
        self.pipe, self.genai, self.tensor, self.conn = pipe, genai, tensor, conn

    @classmethod
    def open(cls, ir: Path, conn: Any) -> PipelineLoop:
        """The pipeline on `ir`, on the CPU, with a paged KV pool of KV_CACHE_GB."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        config = ov_genai.SchedulerConfig()
        config.cache_size = KV_CACHE_GB
        config.enable_prefix_caching = False  # every prompt of a run is new: nothing to reuse
        pipe = ov_genai.ContinuousBatchingPipeline(str(ir), config, "CPU")
        return cls(pipe, ov_genai, lambda ids: ov.Tensor(np.array([ids], dtype=np.int64)), conn)

    def run(self) -> None:
        """Until a None message: admit what arrived, run one step, send its tokens."""
        live: dict[int, Any] = {}
        while True:
            try:
                messages = [self.conn.recv()] if not live else []  # idle: block until a request
                while self.conn.poll():
                    messages.append(self.conn.recv())
            except EOFError:  # the HTTP process is gone
                return
            for message in messages:
                if message is None:
                    return
                if message[0] == "add":
                    live[message[1]] = self._add(*message[1:])
                elif (handle := live.pop(message[1], None)) is not None:  # cancel: blocks freed
                    handle.cancel()
            if not live:
                continue
            self.pipe.step()
            out = [self._read(rid, handle) for rid, handle in live.items()]
            for rid, _, done in out:
                if done:
                    del live[rid]
            self.conn.send([o for o in out if o[1] or o[2]])

    def _add(self, rid: int, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> Any:
        config = self.genai.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.ignore_eos = ignore_eos
        config.do_sample = False
        return self.pipe.add_request(rid, self.tensor(prompt_ids), config)

    def _read(self, rid: int, handle: Any) -> tuple[int, list[int], bool]:
        tokens: list[int] = []
        while handle.can_read():
            for output in handle.read().values():
                tokens.extend(output.generated_ids)
        return rid, tokens, handle.get_status() != self.genai.GenerationStatus.RUNNING


class PipelineClient:
    """The HTTP process's side: `submit` sends a request, a reader thread hands each step's
    tokens to the rows' streams on their event loop and cancels rows whose client left."""

    def __init__(self, conn: Any, eos_ids: frozenset[int]) -> None:
        self.conn, self.eos_ids = conn, eos_ids
        self.rows: dict[int, tuple[Any, asyncio.AbstractEventLoop]] = {}
        self.send_lock = threading.Lock()  # submit (event loop) and cancels (reader) both send
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, name="pipeline-reader", daemon=True)
        self.reader.start()

    def _send(self, message: Any) -> None:
        with self.send_lock:
            self.conn.send(message)

    def submit(self, row: Any) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.rows[rid] = (row, asyncio.get_running_loop())
        self._send(("add", rid, row.prompt_ids, row.max_tokens, row.ignore_eos))

    def stop(self) -> None:
        self._send(None)

    def _read(self) -> None:
        from benchmarks.baselines.generation import deliver, finish_rows

        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError):  # the pipeline process ended
                return
            for rid, tokens, done in batch:
                if rid not in self.rows:
                    continue
                row, loop = self.rows[rid]
                if row.cancelled:  # the client left: the pipeline drops it, frees its blocks
                    del self.rows[rid]
                    self._send(("cancel", rid))
                    continue
                if done:
                    del self.rows[rid]

                def on_loop(row: Any = row, tokens: list[int] = tokens, done: bool = done) -> None:
                    for token in tokens:
                        deliver([row], self.eos_ids, [token])
                    if done:
                        finish_rows([row], None)

                loop.call_soon_threadsafe(on_loop)


def _pipeline_main(ir: Path, conn: Any) -> None:
    """The child process: the pipeline's loop, once it says it is loaded."""
    loop = PipelineLoop.open(ir, conn)
    conn.send("ready")
    loop.run()


def serve(ir: Path, host: str, port: int) -> None:
    """The pipeline in a child process, HTTP here, until SIGTERM/SIGINT."""
    import multiprocessing

    import uvicorn
    from transformers import AutoTokenizer

    from benchmarks.baselines.generation import LoadedModel, Row
    from benchmarks.baselines.protocol import CompletionRequest, create_app

    tokenizer = AutoTokenizer.from_pretrained(ir)
    eos = tokenizer.eos_token_id
    lm = LoadedModel(None, tokenizer, SERVED_NAME, frozenset([eos] if eos is not None else []),
                     int(eos or 0), 2048)
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_pipeline_main, args=(ir, theirs),
                                                         name="openvino-pipeline", daemon=True)
    child.start()
    if ours.recv() != "ready":  # /health answers only once the pipeline is loaded
        raise RuntimeError("the OpenVINO pipeline process did not start")
    engine = PipelineClient(ours, lm.eos_ids)

    def submit(req: CompletionRequest) -> Row:
        row = Row(req.prompt_ids, req.max_tokens, req.ignore_eos)
        engine.submit(row)
        return row

    print(f"OpenVINO GenAI baseline ready: {ir}", flush=True)
    try:
        uvicorn.run(create_app(lm, submit), host=host, port=port, log_level="warning")
    finally:
        engine.stop()
        child.join(timeout=30)


def main(argv_: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--make-venv", action="store_true", help="make the OpenVINO venv (pip)")
    p.add_argument("--export", nargs=2, metavar=("SHAPE", "FORMAT"),
                   help="export a random shape (benchmarks/shapes.py) to IR: int8 or int4")
    p.add_argument("--serve", type=Path, metavar="IR", help="serve this IR folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv_)
    if args.make_venv:
        make_venv()
    if args.export:
        from benchmarks.shapes import random_model

        print(export(random_model(args.export[0]), args.export[1]))
    if args.serve:
        serve(args.serve, args.host, args.port)
    if not (args.make_venv or args.export or args.serve):
        p.print_help()


if __name__ == "__main__":
    main()
