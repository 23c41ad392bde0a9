"""Fault injection for tests only: a ModelRunner wrapper that fails or stalls chosen steps.

The engine has no fault hooks of its own; tests put this between LLMEngine and a real
runner (`LLMEngine(config, runner=FaultyRunner(runner))` or by replacing engine.runner).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine.sample.sampling_batch import GrammarMasks
from engine.worker.model_runner import ModelRunner
from engine.worker.runner_output import RunnerOutput
from scheduler.output import SchedulerOutput


class InjectedFault(RuntimeError):
    pass


class FaultyRunner:
    """Delegates to `runner`. `fail` next steps raise InjectedFault; every step first
    sleeps `delay` s (a slow model, so requests stay in flight long enough to act on);
    `stall()` blocks steps until `unstall()` (a hung step); `entered` is set once a step
    has begun (so a test knows one is in flight)."""

    def __init__(self, runner: ModelRunner, fail: int = 0, delay: float = 0.0) -> None:
        self.runner, self.fail, self.delay = runner, fail, delay
        self.steps = 0
        self.entered = threading.Event()
        self._go = threading.Event()
        self._go.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def stall(self) -> None:
        self._go.clear()

    def unstall(self) -> None:
        self._go.set()

    def execute(self, batch: SchedulerOutput, masks: GrammarMasks | None = None) -> RunnerOutput:
        self.steps += 1
        self.entered.set()
        time.sleep(self.delay)
        self._go.wait(timeout=60)
        if self.fail > 0:
            self.fail -= 1
            raise InjectedFault(f"injected fault in step {self.steps}")
        return self.runner.execute(batch, masks)
