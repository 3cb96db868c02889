"""What the pod tests run inside their pods, in one place."""

from __future__ import annotations

# a TCP server on port 7000: each line it reads comes back numbered ("n line"), one connection at a time
NUMBERING_SERVER = """
import socket
s = socket.socket()
s.bind(("0.0.0.0", 7000))
s.listen()
while True:
    c, _ = s.accept()
    n = 0
    try:
        for line in c.makefile("rb"):
            n += 1
            c.sendall(b"%d %s" % (n, line))
    except OSError:
        pass
    c.close()
"""
