"""`python -m tests.support.endless_compile serve ...`: the CLI with grammar compiles that never
finish (until the process ends), each touching $PAGEDSERVE_TEST_COMPILE_STARTED first: a test's
stand-in for a schema whose compile runs for minutes (no real spec is that slow on the tiny
model's vocabulary). Test code only: the server itself has no such hook."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from api.cli import main
from engine.structured_output.grammar import CompiledGrammar, GrammarBackend
from scheduler.sampling_params import StructuredOutputsParams


def _endless(self: GrammarBackend, so: StructuredOutputsParams) -> CompiledGrammar:
    Path(os.environ["PAGEDSERVE_TEST_COMPILE_STARTED"]).touch()
    threading.Event().wait()  # a C++ compile cannot be interrupted either
    raise AssertionError("unreachable")


if __name__ == "__main__":
    GrammarBackend.compile = _endless  # type: ignore[method-assign]
    main()
