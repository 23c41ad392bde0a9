"""`python -m tests.support.hung_step serve ...`: the CLI whose engine steps hang forever once
a request with seed 7777 is scheduled (touching $PAGEDSERVE_TEST_STEP_HUNG first): a
test's stand-in for a step stuck in a kernel or a device call. Test code only."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from api.cli import main
from engine.worker.model_runner import ModelRunner

MARK = 7777
_execute = ModelRunner.execute


def _hanging(self: ModelRunner, batch: Any, masks: Any = None) -> Any:
    if any(seq.params.seed == MARK for seq in batch.seqs):
        Path(os.environ["PAGEDSERVE_TEST_STEP_HUNG"]).touch()
        threading.Event().wait()  # nothing interrupts a step stuck in C++ either
    return _execute(self, batch, masks)


if __name__ == "__main__":
    ModelRunner.execute = _hanging  # type: ignore[method-assign]
    main()
