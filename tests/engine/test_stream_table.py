"""StreamTable, the open-request table both engine clients share: admission, routing of
deltas, a finished request leaving, an early close, failing everything."""

from __future__ import annotations

import asyncio

import pytest

from engine.client.stream_table import StreamTable
from engine.outputs import RequestOutput
from engine.protocol import EngineDeadError


def delta(rid: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=(1,), new_text="a",
                         finish_reason="length" if finished else None)


def test_admit_route_finish_close_and_fail_all() -> None:
    async def main() -> None:
        closed: list[str] = []
        table = StreamTable(closed.append)
        loop = asyncio.get_running_loop()
        a, admitted_a = table.open(loop, "a")
        _, admitted_b = table.open(loop, "b")
        with pytest.raises(ValueError, match="already in use"):
            table.open(loop, "a")
        table.admit("a", None)
        table.admit("b", ValueError("refused"))
        await admitted_a
        with pytest.raises(ValueError, match="refused"):
            await admitted_b
        table.deliver([delta("a"), delta("a", finished=True), delta("gone")])
        assert [o.finished async for o in a] == [False, True]
        _, admitted_c = table.open(loop, "c")
        d, _ = table.open(loop, "d")
        await d.aclose()  # its consumer left before the end: the client is told
        assert closed == ["d"]
        table.fail_all(EngineDeadError("down"))
        with pytest.raises(EngineDeadError):
            await admitted_c
        assert not table

    asyncio.run(main())
