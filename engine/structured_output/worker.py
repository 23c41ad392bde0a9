"""Grammar compiles in worker processes, bounded in time and memory.

xgrammar's compile is C++ that nothing can interrupt, and some specs take minutes and
gigabytes (a 5,000-property schema ran past 5 minutes on the tiny test vocabulary; tried as an
attacker, a pending compile held a core for over ten minutes while the server's RSS grew from
2.6 to 7.3 GB). So each compile thread (engine/structured_output/manager.py's pool) owns a
worker process: it sends the spec, waits at most COMPILE_TIMEOUT_S, and on a timeout kills
the worker (the next compile starts a new one); the worker's address space may grow by COMPILE_MEMORY_BYTES at
most, past which the compile fails (or the worker dies) instead of the server. Either way the
request gets a 400 naming its field. The compiled grammar comes back serialized
(CompiledGrammar.serialize_json) and is rebuilt against the parent's TokenizerInfo.

Workers fork from multiprocessing's forkserver, which imports this module (and so xgrammar)
once: a worker starts in milliseconds, without the threads of the process that asked.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what json_object means (OpenAI's JSON mode)
COMPILE_TIMEOUT_S = 10.0
COMPILE_MEMORY_BYTES = 2 << 30  # address space a worker may add to what it starts with
_CONTEXT = multiprocessing.get_context("forkserver")


class GrammarError(ValueError):
    """A spec that cannot be compiled (bad schema, regex, grammar or choice list)."""


class CompileLimitError(Exception):
    """The compile hit a limit (time or memory): the spec is too costly, not malformed."""


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, spec: str) -> xgr.CompiledGrammar:
    """The one place a kind of spec becomes an xgrammar compile (worker and tests alike)."""
    if kind == "json":
        # Compact separators: with any whitespace allowed a sampling model can emit spaces
        # forever and never close the object.
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        # An object at the root, any JSON inside: xgrammar's built-in JSON grammar also allows
        # a root array or scalar ([0] came back), which OpenAI's contract does not. Not
        # strict: strict mode would forbid the object's unnamed properties.
        return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False,
                                            strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec))
    return compiler.compile_grammar(spec)


def choice_grammar(spec: str) -> str:
    """A JSON list of strings -> an EBNF grammar that matches exactly one of them."""
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a list of strings")
    if not choices or any(c == "" for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    # json.dumps writes the escapes (\" \\ \n \uXXXX) that EBNF string literals read.
    return "root ::= " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


class CompileWorker:
    """One worker process, used by one thread at a time (each compile thread has its own)."""

    def __init__(self, tokenizer_info: str, timeout_s: float | None = None,
                 memory_bytes: int | None = None) -> None:
        """The bounds default to COMPILE_TIMEOUT_S and COMPILE_MEMORY_BYTES as they are when
        the worker is made."""
        self._info = tokenizer_info  # TokenizerInfo.serialize_json()
        self.timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        self.memory_bytes = COMPILE_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._proc: Any = None
        self._conn: Connection | None = None

    def compile(self, kind: str, spec: str) -> str:
        """The compiled grammar, serialized. ValueError (xgrammar's message) for a bad spec;
        CompileLimitError past the time or memory bound."""
        conn = self._connection()
        conn.send((kind, spec))
        if not conn.poll(self.timeout_s):
            self.close()
            raise CompileLimitError(f"compiling it took longer than {self.timeout_s:g} s")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            self.close()  # it died: an allocation past its limit aborted it
            raise CompileLimitError(self._memory_message()) from None
        if status == "ok":
            return str(payload)
        if status == "memory":
            self.close()  # its heap may be in any state now
            raise CompileLimitError(self._memory_message())
        raise ValueError(payload)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def _connection(self) -> Connection:
        if self._conn is None or self._proc is None or not self._proc.is_alive():
            self.close()
            _CONTEXT.set_forkserver_preload(["engine.structured_output.worker"])
            ours, theirs = _CONTEXT.Pipe()
            self._proc = _CONTEXT.Process(target=_serve, args=(theirs, self._info,
                                                                self.memory_bytes),
                                          name="pagedserve-grammar-worker", daemon=True)
            self._proc.start()
            theirs.close()
            self._conn = ours
        return self._conn

    def _memory_message(self) -> str:
        return f"compiling it needed more than {self.memory_bytes / 2**30:g} GiB of memory"


def _serve(conn: Connection, tokenizer_info: str, memory_bytes: int) -> None:
    """The worker: compile what comes, one spec at a time, under its memory limit."""
    _limit_address_space(memory_bytes)
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe (or exited)
        try:
            reply = ("ok", compile_spec(compiler, kind, spec).serialize_json())
        except MemoryError:
            reply = ("memory", "")
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
            reply = ("memory", "") if "bad_alloc" in str(e) else ("error", str(e))
        conn.send(reply)


def _limit_address_space(extra: int) -> None:
    """RLIMIT_AS at what the process maps now plus `extra`: a compile that allocates past it
    fails (std::bad_alloc, or the process dies), and the server does not."""
    with open(f"/proc/{os.getpid()}/status") as f:
        size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = size_kb * 1024 + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
