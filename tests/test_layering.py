"""Import direction: api -> engine (protocol/outputs/config) -> scheduler; neither api nor
scheduler may load torch or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib, pkgutil, sys
import api, scheduler
names = []
for pkg in (api, scheduler):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        names.append(m.name)
        importlib.import_module(m.name)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(len(names), ",".join(heavy))
"""


def test_api_and_scheduler_do_not_load_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert int(out[0]) >= 10, out  # the walk found the modules
    assert len(out) == 1, f"loaded: {out[1]}"
