"""The batch pipeline of push and pull: ``work(batch)`` on ``inflight`` threads, and at the first
failure nothing more is started: batches still queued are dropped (never sent), the caller's next
:meth:`Pipeline.submit` raises, and the first error is raised again once the running ones have
finished. ``max_pending`` bounds how many batches may wait (submit then blocks)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Pipeline(Generic[T]):
    def __init__(self, work: Callable[[T], None], inflight: int, max_pending: int | None = None) -> None:
        self.inflight = max(1, inflight)
        self._work = work
        self._pool = ThreadPoolExecutor(max_workers=self.inflight, thread_name_prefix="batch")
        self._slots = threading.Semaphore(max(self.inflight, max_pending)) if max_pending is not None else None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.started = 0
        self._open = 0                       # submitted and not yet done
        self._idle = threading.Condition(self._lock)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _run(self, item: T) -> None:
        try:
            if self._error is None:
                with self._lock:
                    self.started += 1
                self._work(item)
        except BaseException as exc:  # noqa: BLE001 - kept, and raised in the caller's thread
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            with self._lock:
                self._open -= 1
                if not self._open:
                    self._idle.notify_all()
            if self._slots is not None:
                self._slots.release()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, item: T) -> None:
        """Queue ``item`` (waiting while ``max_pending`` are queued or running); raises the first failure."""
        self._raise()
        if self._slots is not None:
            self._slots.acquire()
            if self._error is not None:
                self._slots.release()
                self._raise()
        with self._lock:
            self._open += 1
        self._pool.submit(self._run, item)

    def drain(self) -> None:
        """Wait until every batch submitted is done (the pipeline stays open); raise the first failure."""
        with self._lock:
            while self._open:
                self._idle.wait()
        self._raise()

    def close(self) -> None:
        """Wait for every batch (those after a failure are skipped); raise the first failure."""
        self._pool.shutdown(wait=True)
        self._raise()

    def __enter__(self) -> Pipeline[T]:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:  # the caller failed: start nothing more, let the running ones finish
            with self._lock:
                if self._error is None and isinstance(exc, BaseException):
                    self._error = exc
            self._pool.shutdown(wait=True, cancel_futures=True)
            return
        self.close()


def run_batches(batches: Iterable[T], inflight: int, work: Callable[[T], None]) -> None:
    """``work`` on every batch, ``inflight`` at a time; stops at the first failure and raises it. ``batches``
    is taken from only as work is done (a generator may size each batch when it is taken)."""
    with Pipeline(work, inflight, max_pending=max(2, inflight)) as pipe:
        for batch in batches:
            pipe.submit(batch)
