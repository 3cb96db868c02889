"""Object-stream segments taken in order, without holding a thread while they wait.

Uploads of one stream travel on several connections at once, so segment 5 can arrive before segment 4.
It waits here (on the event loop, not in the thread pool, where enough waiting uploads would starve the
one they wait for) until the stream has taken every segment before it, or ``WAIT_S`` has passed; then it
goes on, and the stream takes it or says it is lost (``capsule/exchange/streams.py``)."""

from __future__ import annotations

import asyncio
import contextlib

from capsule.exchange.streams import Streams

# A sender keeps one upload of a stream in flight (capsule/transfer/pushing.py), so a segment waits here only
# when its predecessor's upload is still being handled, or never comes (the receiver restarted): then
# the sender hears stream_lost after this long and starts a new stream.
WAIT_S = 5.0


class Turns:
    def __init__(self, streams: Streams, wait_s: float = WAIT_S) -> None:
        self._streams = streams
        self._wait_s = wait_s
        self._changed: asyncio.Condition | None = None   # made on the loop that first uses it

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def wait(self, key: tuple[str, str], sid: str, seq: int) -> None:
        """Until segment ``seq`` of stream ``sid`` is next (or taken already), at most ``wait_s``."""
        if seq == 0:
            return

        def ready() -> bool:
            taken = self._streams.position(key, sid)
            return taken is not None and taken >= seq

        cond = self._condition()
        async with cond:
            with contextlib.suppress(TimeoutError):  # then the stream decides: lost, or out of order
                await asyncio.wait_for(cond.wait_for(ready), self._wait_s)

    async def advance(self) -> None:
        """A segment was taken (or refused): wake the uploads waiting for their turn."""
        cond = self._condition()
        async with cond:
            cond.notify_all()
