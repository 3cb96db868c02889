"""A store's lock held by another thread for the length of a ``with`` block: what a long operation (a suspend, a
push) does to everything else that wants the lock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def lock_held(store, purpose: str = "other work") -> Iterator[None]:
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store.lock(purpose=purpose):
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10), "the other thread never got the store's lock"
        yield
    finally:
        done.set()
        t.join(10)
