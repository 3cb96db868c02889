"""A TCP proxy that adds a fixed one-way delay in each direction, and optionally a rate.

The kernel here has tbf (rate) but not netem (delay), so latency is added in
user space: every chunk read from one side is written to the other side
``delay`` seconds later, in order. ``--rate-kbit`` also paces each direction,
all connections together, to that rate (a link of that rate without network
namespaces: a chunk leaves when the chunks before it in that direction had
their time), with at most ``QUEUE`` chunks queued per connection and direction
(then the sender waits, as a full router queue makes it).

    python testkit/delayproxy.py --listen 127.0.0.1:9000 --to 198.18.1.2:7070 --delay-ms 10
    python testkit/delayproxy.py --listen 127.0.0.1:9000 --to 127.0.0.1:7070 --delay-ms 10 --rate-kbit 20000
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

QUEUE = 16                                   # chunks (up to 64 KiB) queued per connection and direction, rated
_free = {"up": 0.0, "down": 0.0}             # when each direction's link is free again (with a rate)


def _due(direction: str, size: int, delay: float, rate: float) -> float:
    """When a chunk of ``size`` bytes read now is written on: after ``delay``, and with ``rate`` (bytes/s),
    after the direction's chunks before it had their time."""
    now = time.monotonic()
    if not rate:
        return now + delay
    _free[direction] = max(now, _free[direction]) + size / rate
    return _free[direction] + delay


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, direction: str = "up",
                rate: float = 0.0) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE if rate else 0)

    async def sender() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    task = asyncio.create_task(sender())
    try:
        while True:
            data = await reader.read(65536)
            await queue.put((_due(direction, len(data), delay, rate), data))
            if not data:
                break
        await task
    except (ConnectionError, asyncio.CancelledError):
        task.cancel()
        writer.close()


async def main(listen: str, to: str, delay: float, mss: int = 0, rate: float = 0.0) -> None:
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = to.rsplit(":", 1)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pump(cr, uw, delay, "up", rate), _pump(ur, cw, delay, "down", rate),
                             return_exceptions=True)

    if mss:     # the segment size the other end may send here: a real link's, not loopback's 64 KiB
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
        sock.bind((lhost, int(lport)))
        server = await asyncio.start_server(handle, sock=sock)
    else:
        server = await asyncio.start_server(handle, lhost, int(lport))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--to", required=True)
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay (RTT = 2x)")
    ap.add_argument("--mss", type=int, default=0, help="the TCP segment size clients may send to the proxy (0: the "
                                                       "interface's; loopback's is 64 KiB)")
    ap.add_argument("--rate-kbit", type=int, default=0, help="each direction's rate, all connections together "
                                                             "(0: none)")
    a = ap.parse_args()
    asyncio.run(main(a.listen, a.to, a.delay_ms / 1000.0, a.mss, a.rate_kbit * 1000 / 8))
