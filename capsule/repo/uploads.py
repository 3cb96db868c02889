"""Packs uploaded in the background while the next ones are sealed.

A push used to wait for each pack's PUT before sealing the next: on loopback to SeaweedFS a third of a push
was spent waiting for the store's answer (``bench/repo_throughput.py``; cProfile: 1.1 s of 3.2 s in
``recv``). :class:`Uploads` keeps up to ``workers`` PUTs in flight and at most ``depth`` more packs waiting, so
memory stays bounded (a few packs of a few MiB) and sealing goes on meanwhile.

The first failure is raised by the next :meth:`Uploads.put` or by :meth:`Uploads.wait`; what was uploaded
before it stays in the bucket unindexed, as a push killed half-way leaves it, and the next push adopts it."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from capsule.repo.s3 import S3Client

WORKERS = 2     # PUTs at once: the store answers one while the other's body is still being sent
DEPTH = 2       # sealed packs waiting for a worker, beyond those in flight


class Uploads:
    """``with Uploads(client) as up: up.put(key, body) … up.wait()``: every PUT done (or the first failure
    raised) when :meth:`wait` returns; leaving the block early abandons the PUTs not yet started."""

    def __init__(self, client: S3Client, workers: int = WORKERS, depth: int = DEPTH) -> None:
        if workers < 1 or depth < 0:
            raise ValueError("uploads need at least one worker and a depth of zero or more")
        self.client = client
        self._limit = workers + depth
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="repo-upload")
        self._pending: deque[Future[None]] = deque()

    def put(self, key: str, body: bytes) -> None:
        """PUT ``body`` at ``key`` in the background; blocks while ``workers + depth`` are unfinished."""
        self._reap(until=self._limit - 1)
        self._pending.append(self._pool.submit(self.client.put, key, body))

    def wait(self) -> None:
        """Every PUT given so far done; the first failure among them raised."""
        self._reap(until=0)

    def _reap(self, until: int) -> None:
        while self._pending and (len(self._pending) > until or self._pending[0].done()):
            self._pending.popleft().result()      # raises the PUT's own error (Unreachable, AuthFailed, …)

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Uploads:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
