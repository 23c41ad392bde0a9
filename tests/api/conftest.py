from __future__ import annotations

from collections.abc import Iterator

import pytest
from apitools import serve
from fake_engine import FakeEngine
from starlette.testclient import TestClient


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with serve(engine) as c:
        yield c
