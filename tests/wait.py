"""Waiting in tests: always with a deadline, and a failure that says what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> T:
    """Call ``predicate`` until it returns something true and return that; after ``timeout``
    seconds fail the test with ``what`` (what was being waited for; a callable is asked then,
    so the message can show the last state seen)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)
