"""The default test run draws the same Hypothesis examples every time (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


@pytest.mark.skipif("HYPOTHESIS_PROFILE" in os.environ, reason="another profile was asked for")
def test_the_default_run_is_derandomized() -> None:
    current = settings()  # a settings object takes the loaded profile's values
    assert current.derandomize
    assert current.database is None  # no examples replayed from an earlier run
