"""The programs test_pods_cases.py runs as pods, one per Laadan–Nieh case, and the prelude they share.

Each program is a generator ``case()``: it sets its state up and yields a report of it (written to
/tmp/ready.json in the pod), then waits for /tmp/go (the test makes it after the restore), goes on and
yields what it found (written to /tmp/result.json). A failure writes {"error": traceback} instead. Between
the two the pod is checkpointed (it dies) and restored, so the second half runs in the restored processes.
"""

from __future__ import annotations

from pods.ckpt import GHOST_LIMIT  # what a pod image carries of a deleted file
from tests.vm import podcasekit_state

PRELUDE = r"""
import ctypes, hashlib, json, os, select, signal, sys, time, traceback
libc = ctypes.CDLL("libc.so.6", use_errno=True)

def put(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)

def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgrp": int(fields[2]), "session": int(fields[3]),
            "tty": int(fields[4])}

def syscall(pid):
    with open(f"/proc/{pid}/syscall") as f:
        return f.read().split()[0]

def until(test, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)

def read_exactly(fd, n, timeout=20.0):
    got = b""
    while len(got) < n:
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"{len(got)} of {n} bytes")
        got += os.read(fd, n - len(got))
    return got

def sha(data):
    return hashlib.sha256(data).hexdigest()

def run(case):
    main = os.getpid()
    try:
        steps = case()
        put("/tmp/ready.json", next(steps))
        until(lambda: os.path.exists("/tmp/go"), "the go", timeout=3600)
        put("/tmp/result.json", next(steps))
    except BaseException:
        if os.getpid() != main:
            os._exit(1)
        done = os.path.exists("/tmp/ready.json")
        put("/tmp/result.json" if done else "/tmp/ready.json", {"error": traceback.format_exc()})
    while True:
        time.sleep(1)
"""


PIPES = r"""
def case():
    payload = os.urandom(48 << 10)                # in flight: nobody reads it before the checkpoint
    r, w = os.pipe()
    os.write(w, payload)
    wake_r, wake_w = os.pipe()
    reader = os.fork()
    if reader == 0:                               # asleep in read(2) across the checkpoint
        os.close(wake_w)
        got = os.read(wake_r, 100)
        with open("/tmp/reader-woke", "wb") as f:
            f.write(got)
        os._exit(0)
    os.close(wake_r)
    until(lambda: syscall(reader) == "0", "the reader in read(2)")
    yield {"reader": reader, "reader_state": stat(reader)["state"], "reader_syscall": syscall(reader),
           "in_flight": len(payload), "sha": sha(payload)}
    state, call = stat(reader)["state"], syscall(reader)
    got = read_exactly(r, len(payload))
    left = select.select([r], [], [], 0)[0]       # nothing more than what was in flight
    os.write(w, b"and a write after the restore")
    again = os.read(r, 100)
    os.write(wake_w, b"woken after the restore")
    _, status = os.waitpid(reader, 0)
    yield {"reader": reader, "reader_state": state, "reader_syscall": call, "in_flight": len(got),
           "sha": sha(got), "more": bool(left), "again": again.decode(),
           "reader_got": open("/tmp/reader-woke").read(), "reader_exit": os.waitstatus_to_exitcode(status)}

run(case)
"""


UNIX = r"""
import socket

def case():
    stream = os.urandom(32 << 10)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    da, db = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    peer = os.fork()
    if peer == 0:                                 # holds the far ends; reads only after the restore
        a.close(); da.close()
        until(lambda: os.path.exists("/tmp/go"), "the go", timeout=3600)
        got = b""
        while len(got) < len(stream):
            got += b.recv(len(stream) - len(got))
        grams = [db.recv(100).decode() for _ in range(2)]
        b.sendall(b"reply on the stream")
        db.send(b"reply datagram")
        put("/tmp/peer.json", {"sha": sha(got), "n": len(got), "grams": grams})
        os._exit(0)
    b.close(); db.close()
    a.sendall(stream)                             # in flight on the stream pair
    da.send(b"first datagram")                    # in flight, two messages with their bounds
    da.send(b"second")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("/tmp/named.sock")              # a named socket, bound in the pod's /tmp
    listener.listen()
    yield {"peer": peer, "sha": sha(stream), "n": len(stream)}
    until(lambda: os.path.exists("/tmp/peer.json"), "the peer's report")
    with open("/tmp/peer.json") as f:
        peer_saw = json.load(f)
    replies = [a.recv(100).decode(), da.recv(100).decode()]
    os.waitpid(peer, 0)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect("/tmp/named.sock")             # a new client reaches the restored listener
    conn, _ = listener.accept()
    client.sendall(b"new connection")
    yield {"peer": peer_saw, "replies": replies, "named": conn.recv(100).decode()}

run(case)
"""


UNIX_PENDING = r"""
import socket

def case():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("/tmp/pending.sock")
    listener.listen()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect("/tmp/pending.sock")           # in the listener's backlog, not accepted yet
    client.sendall(b"sent before the accept")
    yield {}
    listener.settimeout(5)
    conn, _ = listener.accept()
    conn.settimeout(3)
    try:
        early = conn.recv(100).decode()
    except socket.timeout:
        early = None
    client.sendall(b"sent after the restore")
    later = conn.recv(100).decode()
    conn.sendall(b"and back")
    yield {"early": early, "later": later, "back": client.recv(100).decode()}

run(case)
"""


SHM = r"""
import mmap

def case():
    anon = mmap.mmap(-1, 4096)                    # MAP_SHARED | MAP_ANONYMOUS, shared with the child
    fd = os.open("/dev/shm/pod-case", os.O_RDWR | os.O_CREAT, 0o600)   # POSIX shm: what shm_open opens
    os.ftruncate(fd, 4096)
    posix = mmap.mmap(fd, 4096)
    anon[16:32] = b"anonymous marker"
    posix[16:32] = b"posix shm marker"
    writer = os.fork()
    if writer == 0:                               # writes both pages; the parent reads them
        while True:
            for page in (anon, posix):
                page[:8] = (int.from_bytes(page[:8], "little") + 1).to_bytes(8, "little")
            time.sleep(0.1)
    count = lambda page: int.from_bytes(page[:8], "little")
    until(lambda: count(anon) > 3 and count(posix) > 3, "the writer's first writes")
    yield {"writer": writer, "anon": count(anon), "posix": count(posix)}
    kept = {"anon": count(anon), "posix": count(posix), "anon_marker": anon[16:32].decode(),
            "posix_marker": posix[16:32].decode()}
    until(lambda: count(anon) > kept["anon"] + 3 and count(posix) > kept["posix"] + 3, "the writer going on")
    with open("/dev/shm/pod-case", "rb") as f:    # a fresh open sees the same object
        fresh = f.read(32)
    os.kill(writer, signal.SIGKILL)
    os.waitpid(writer, 0)
    yield {**kept, "rising": True, "fresh": fresh[16:32].decode(),
           "fresh_count_at_least": int.from_bytes(fresh[:8], "little") >= kept["posix"]}

run(case)
"""


SHM_UNLINKED = r"""
import mmap

def case():
    fd = os.open("/dev/shm/pod-big", os.O_RDWR | os.O_CREAT, 0o600)   # shm_open, mmap, shm_unlink
    os.ftruncate(fd, SIZE)
    shared = mmap.mmap(fd, SIZE)
    os.close(fd)
    os.unlink("/dev/shm/pod-big")                 # only the mapping holds it now
    shared[:12] = b"still mapped"
    shared[-4:] = b"tail"
    yield {"size": len(shared)}
    yield {"marker": shared[:12].decode(), "tail": shared[-4:].decode()}

run(case)
"""


LOCKS = r"""
import fcntl

def can_lock(how):
    probe = os.fork()
    if probe == 0:                                # another process, its own open file description
        with open("/tmp/lockfile", "r+") as f:
            try:
                how(f)
            except BlockingIOError:
                os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) == 0

def whole(f):
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

def record(f):
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 100)

def case():
    whole_lock = open("/tmp/lockfile", "w+")
    fcntl.flock(whole_lock, fcntl.LOCK_EX)        # a flock(2) lock
    rec_lock = open("/tmp/lockfile", "r+")
    fcntl.lockf(rec_lock, fcntl.LOCK_EX, 10, 100)  # a POSIX record lock on bytes 100–109
    yield {"flock_free": can_lock(whole), "posix_free": can_lock(record)}
    held = {"flock_free": can_lock(whole), "posix_free": can_lock(record)}
    fcntl.flock(whole_lock, fcntl.LOCK_UN)
    fcntl.lockf(rec_lock, fcntl.LOCK_UN, 10, 100)
    yield {**held, "freed": [can_lock(whole), can_lock(record)]}

run(case)
"""


CASES = {"pipes": PIPES, "unix": UNIX, "unix-pending": UNIX_PENDING, "shm": SHM,
         "shm-unlinked": SHM_UNLINKED.replace("SIZE", "(4 << 20)"),
         "shm-unlinked-huge": SHM_UNLINKED.replace("SIZE", f"({(GHOST_LIMIT >> 20) + 1} << 20)"),
         "locks": LOCKS, **podcasekit_state.CASES}


def program(case: str) -> str:
    """The whole program of pod ``case``: the prelude, then the case."""
    return PRELUDE + CASES[case]
