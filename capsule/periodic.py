"""A job the agent runs in the background every few seconds (:class:`Periodic`): the localizer
(``capsule/lifecycle/localizer.py``), the watch over stranded post-copies (``capsule/exchange/stranded.py``)."""

from __future__ import annotations

import threading
from typing import Self


class Periodic:
    """A daemon thread named :attr:`thread_name` that calls :meth:`round` every ``poll`` seconds (the first
    after ``poll``) until :meth:`stop`. A round handles its own errors: one that raises ends the thread."""

    thread_name = "capsule-periodic"

    def __init__(self, poll: float) -> None:
        self.poll = poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def round(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.round()

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
