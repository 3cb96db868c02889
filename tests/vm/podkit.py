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

# its client: one connection to ADDR:7000; line i must come back as "i i"; one log line per round trip
# ("i time", or ERROR/BAD and the end); it stops once the file STOP exists, if one is named
#     python3 client.py ADDR LOG [STOP]
NUMBERING_CLIENT = """
import os, socket, sys, time
addr, log_path = sys.argv[1], sys.argv[2]
stop = sys.argv[3] if len(sys.argv) > 3 else None
log = open(log_path, "a", buffering=1)
s = socket.create_connection((addr, 7000), timeout=600)
f = s.makefile("rb")
i = 0
while not (stop and os.path.exists(stop)):
    i += 1
    try:
        s.sendall(b"%d\\n" % i)
        reply = f.readline()
    except OSError as e:
        log.write(f"ERROR {i} {e}\\n")
        break
    if reply != b"%d %d\\n" % (i, i):
        log.write(f"BAD {i} {reply!r}\\n")
        break
    log.write(f"{i} {time.time():.3f}\\n")
    time.sleep(0.2)
"""
