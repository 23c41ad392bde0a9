"""A headless Chromium driven by Playwright (Debian's `chromium`, never a downloaded browser),
and the real SmolLM2 behind a live server for the pages to talk to.

Without a Chromium (or Playwright) the browser tests skip, unless PAGEDSERVE_REQUIRE_BROWSER
is set, as `.ci/run` sets it after installing Debian's package: then a missing browser fails
the run instead of skipping it silently."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine.conftest import smollm2_runner  # noqa: F401 - the fixture, for this folder

BROWSERS = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    given = os.environ.get("PAGEDSERVE_CHROMIUM")
    if given:
        return given
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        path = None
    if path is None:
        if os.environ.get("PAGEDSERVE_REQUIRE_BROWSER"):
            pytest.fail("PAGEDSERVE_REQUIRE_BROWSER is set but no chromium (or playwright)")
        pytest.skip("no chromium: apt-get install chromium (and pip install playwright)")
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()
