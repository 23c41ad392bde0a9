"""DaemonPool: a thread pool whose threads never keep the process alive.

concurrent.futures.ThreadPoolExecutor joins its threads when the interpreter exits, so a
grammar compile that runs for minutes (xgrammar's C++ cannot be interrupted) held a server
that had finished its graceful shutdown alive until the compile ended. These threads are
daemons: at exit a running compile is simply dropped, and its request has been answered by
then (engine shutdown fails every open request).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(RuntimeError("the pool is shut down"))
        else:
            self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Queued jobs are cancelled; running ones finish (or die with the process)."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)  # wakes one worker, which passes it on: all of them end

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the future carries it to the waiter
                future.set_exception(e)
        self._jobs.put(None)
