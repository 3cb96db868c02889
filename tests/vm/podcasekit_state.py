"""The programs of test_pods_cases.py for a process's kernel state (signals, timers, a pty, inotify,
eventfd, a process tree with zombies): see podcasekit for how they run."""

from __future__ import annotations

SIGNALS = r"""
import threading

RT = signal.SIGRTMIN + 2
SI_QUEUE = -1

def pending_lines():
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (ln.split(":", 1) for ln in f) if k in ("SigQ", "SigPnd", "ShdPnd", "SigBlk")}

def take_rt():
    mask = ctypes.create_string_buffer(128)
    libc.sigemptyset(mask)
    libc.sigaddset(mask, RT)
    info = ctypes.create_string_buffer(128)
    ts = (ctypes.c_long * 2)(5, 0)
    sig = libc.sigtimedwait(mask, info, ts)
    code = int.from_bytes(info.raw[8:12], "little", signed=True)
    return [sig, code, int.from_bytes(info.raw[16:20], "little"), int.from_bytes(info.raw[24:28], "little")]

def case():
    delivered = []
    signal.signal(signal.SIGUSR1, lambda s, f: delivered.append("SIGUSR1"))
    signal.signal(signal.SIGUSR2, lambda s, f: delivered.append("SIGUSR2"))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2, RT})
    os.kill(os.getpid(), signal.SIGUSR1)                                 # pending for the process
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)           # pending for this thread
    for value in (11, 22, 33):                                           # a realtime queue with values
        if libc.sigqueue(os.getpid(), RT, ctypes.c_void_p(value)) != 0:
            raise OSError(ctypes.get_errno(), "sigqueue")
    yield {"pid": os.getpid(), "pending": sorted(int(s) for s in signal.sigpending()), **pending_lines(),
           "delivered": list(delivered)}
    seen = {"pending": sorted(int(s) for s in signal.sigpending()), **pending_lines()}
    queue = [take_rt() for _ in range(3)]
    left = sorted(int(s) for s in signal.sigpending())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    until(lambda: len(delivered) == 2, "the handlers")
    os.kill(os.getpid(), signal.SIGUSR1)                                 # and signals go on working
    until(lambda: len(delivered) == 3, "a new signal")
    yield {"pid": os.getpid(), **seen, "rt_queue": queue, "delivered": delivered, "rt": int(RT),
           "si_queue": SI_QUEUE, "left": left}

run(case)
"""


TIMER_TOOLS = r"""
import statistics

class timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

class itimerspec(ctypes.Structure):
    _fields_ = [("interval", timespec), ("value", timespec)]

class sigevent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]

CLOCK_MONOTONIC, SIGEV_SIGNAL = 1, 0

def spec(interval, first=None):
    def ts(s):
        return timespec(int(s), int(round((s % 1) * 1e9)))
    return itimerspec(ts(interval), ts(interval if first is None else first))

def secs(ts):
    return round(ts.sec + ts.nsec / 1e9, 3)

def timerfd(interval):
    fd = libc.timerfd_create(CLOCK_MONOTONIC, 0)
    if fd < 0 or libc.timerfd_settime(fd, 0, ctypes.byref(spec(interval)), None) != 0:
        raise OSError(ctypes.get_errno(), "timerfd")
    return fd

def timerfd_get(fd):
    t = itimerspec()
    libc.timerfd_gettime(fd, ctypes.byref(t))
    return {"value": secs(t.value), "interval": secs(t.interval)}

def fdinfo(fd):
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return {k: v.strip() for k, v in (ln.split(":", 1) for ln in f)}
"""


TIMERS = TIMER_TOOLS + r"""
RT = signal.SIGRTMIN + 3
PERIOD = {"itimer": 0.25, "posix": 0.3}

def period(ticks):
    return round(statistics.median(b - a for a, b in zip(ticks, ticks[1:])), 3)

def case():
    ticks = {"itimer": [], "posix": []}
    signal.signal(signal.SIGALRM, lambda s, f: ticks["itimer"].append(time.monotonic()))
    signal.signal(RT, lambda s, f: ticks["posix"].append(time.monotonic()))
    signal.setitimer(signal.ITIMER_REAL, PERIOD["itimer"], PERIOD["itimer"])     # setitimer(2)
    ev = sigevent(ctypes.c_void_p(77), int(RT), SIGEV_SIGNAL)
    timer = ctypes.c_void_p()                                                     # timer_create(2)
    if libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(ev), ctypes.byref(timer)) != 0:
        raise OSError(ctypes.get_errno(), "timer_create")
    libc.timer_settime(timer, 0, ctypes.byref(spec(PERIOD["posix"])), None)
    slow = timerfd(60.0)                          # a timerfd armed, its first expiry a minute away
    until(lambda: len(ticks["itimer"]) >= 3 and len(ticks["posix"]) >= 3, "the first ticks")

    def intervals():
        p = itimerspec()
        libc.timer_gettime(timer, ctypes.byref(p))
        return {"itimer": round(signal.getitimer(signal.ITIMER_REAL)[1], 3), "posix": secs(p.interval)}

    yield {"intervals": intervals(), "timerfd": timerfd_get(slow)}
    kept, slow_kept = intervals(), timerfd_get(slow)
    for t in ticks.values():
        t.clear()
    time.sleep(2.5)                               # the restored timers firing
    signal.setitimer(signal.ITIMER_REAL, 0)
    libc.timer_delete(timer)
    yield {"intervals": kept, "timerfd": slow_kept, "periods": PERIOD,
           "measured": {name: period(t) for name, t in ticks.items()},
           "counts": {name: len(t) for name, t in ticks.items()}}

run(case)
"""


TIMERFD_DUE = TIMER_TOOLS + r"""
def case():
    fd = timerfd(0.2)                             # fires every 0.2 s; nobody reads it before the checkpoint
    until(lambda: int(fdinfo(fd)["ticks"]) >= 1, "the timerfd's first expiry")   # due, and left unread
    yield {"fdinfo": fdinfo(fd)}
    restored = fdinfo(fd)
    pending = int.from_bytes(os.read(fd, 8), "little")
    more = select.select([fd], [], [], 1.5)[0]     # seven periods: does it fire again?
    yield {"fdinfo": restored, "pending": pending, "fired_again": bool(more), "gettime": timerfd_get(fd)}

run(case)
"""


PTY = r"""
import fcntl, struct, subprocess, termios, tty

def case():
    # a pod has no /dev/pts of its own: it mounts a devpts instance, as a container's runtime does
    os.makedirs("/dev/pts", exist_ok=True)
    subprocess.run(["mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=0620", "devpts", "/dev/pts"],
                   check=True)
    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 77, 0, 0))
    child = os.fork()
    if child == 0:                                # a session on the pty: it is its controlling terminal
        os.close(master)
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(slave, fd)
        os.write(1, b"output nobody has read yet\n")
        line = os.read(0, 100)                    # asleep reading its terminal across the checkpoint
        os.write(1, b"got " + line)
        os._exit(0)
    os.close(slave)
    until(lambda: syscall(child) == "0", "the child reading its terminal")
    name = os.readlink(f"/proc/{child}/fd/0")
    yield {"child": child, "tty": name, "child_stat": stat(child)}
    child_stat = stat(child)
    unread = read_exactly(master, len(b"output nobody has read yet\n"))
    rows, cols = struct.unpack("HHHH", fcntl.ioctl(master, termios.TIOCGWINSZ, b"\0" * 8))[:2]
    os.write(master, b"input after the restore\n")
    answer = read_exactly(master, len(b"got input after the restore\n"))
    _, status = os.waitpid(child, 0)
    yield {"child": child, "tty": name, "child_stat": child_stat, "unread": unread.decode(),
           "winsize": [rows, cols], "answer": answer.decode(), "exit": os.waitstatus_to_exitcode(status)}

run(case)
"""


INOTIFY = r"""
import struct

IN_CREATE = 0x100

def events(fd):
    out = []
    while select.select([fd], [], [], 0.5)[0]:
        raw = os.read(fd, 4096)
        while raw:
            wd, mask, _cookie, n = struct.unpack_from("iIII", raw)
            out.append([wd, mask, raw[16:16 + n].rstrip(b"\0").decode()])
            raw = raw[16 + n:]
    return out

def case():
    os.makedirs("/tmp/watched")
    fd = libc.inotify_init1(0)
    wd = libc.inotify_add_watch(fd, b"/tmp/watched", IN_CREATE)
    if fd < 0 or wd < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    open("/tmp/watched/before", "w").close()
    first = events(fd)
    open("/tmp/watched/unread", "w").close()      # an event queued, unread at the checkpoint
    yield {"wd": wd, "first": first}
    queued = events(fd)
    open("/tmp/watched/after-restore", "w").close()
    yield {"wd": wd, "queued": queued, "after": events(fd)}

run(case)
"""


EVENTFD = r"""
def case():
    counter = os.eventfd(0)
    os.eventfd_write(counter, 5)
    os.eventfd_write(counter, 37)                 # the counter holds 42
    sem = os.eventfd(3, os.EFD_SEMAPHORE | os.EFD_NONBLOCK)
    first = os.eventfd_read(sem)                  # a semaphore: a read takes 1 (2 left)
    wake = os.eventfd(0)
    waiter = os.fork()
    if waiter == 0:                               # asleep in read(2) on an eventfd across the checkpoint
        with open("/tmp/waiter", "w") as f:
            f.write(str(os.eventfd_read(wake)))
        os._exit(0)
    until(lambda: syscall(waiter) == "0", "the waiter in read(2)")
    yield {"waiter": waiter, "semaphore": [first]}
    value = os.eventfd_read(counter)
    takes = [first]
    while len(takes) < 4:
        try:
            takes.append(os.eventfd_read(sem))
        except BlockingIOError:
            takes.append("empty")
    os.eventfd_write(wake, 9)
    os.waitpid(waiter, 0)
    yield {"waiter": waiter, "counter": value, "semaphore": takes, "waiter_got": open("/tmp/waiter").read()}

run(case)
"""


TREE = r"""
def tree(pids):
    return {name: stat(pid) for name, pid in pids.items()}

def case():
    zombie = os.fork()
    if zombie == 0:
        os._exit(7)                               # never reaped before the restore: a zombie
    killed = os.fork()
    if killed == 0:
        time.sleep(3600)
        os._exit(0)
    os.kill(killed, signal.SIGKILL)               # a zombie killed by a signal
    grand = os.pipe()
    middle = os.fork()
    if middle == 0:                               # a subtree: its own group, a sleeper and a zombie of its own
        os.setpgid(0, 0)
        sleeper = os.fork()
        if sleeper == 0:
            while True:
                time.sleep(1)
        own = os.fork()
        if own == 0:
            os._exit(3)
        os.write(grand[1], json.dumps([sleeper, own]).encode())
        until(lambda: os.path.exists("/tmp/reap"), "the word to reap", timeout=3600)
        _, status = os.waitpid(own, 0)
        put("/tmp/middle.json", {"own": os.waitstatus_to_exitcode(status)})
        os._exit(0)
    sleeper, own = json.loads(os.read(grand[0], 100))
    pids = {"main": os.getpid(), "zombie": zombie, "killed": killed, "middle": middle, "sleeper": sleeper,
            "own": own}
    until(lambda: all(stat(p)["state"] == "Z" for p in (zombie, killed, own)), "the zombies")
    yield {"pids": pids, "tree": tree(pids)}
    kept = tree(pids)
    open("/tmp/reap", "w").close()                # now the middle may reap its own zombie
    statuses = {name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in
                (("zombie", zombie), ("killed", killed))}
    until(lambda: os.path.exists("/tmp/middle.json"), "the middle's report")
    with open("/tmp/middle.json") as f:
        statuses.update(json.load(f))
    os.waitpid(middle, 0)
    child = os.fork()                             # the tree goes on: a new child is born and reaped
    if child == 0:
        os._exit(5)
    statuses["new"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    yield {"pids": pids | {"main": os.getpid()}, "tree": kept, "statuses": statuses,
           "sleeper_alive": stat(sleeper)["state"] in "RS"}

run(case)
"""


CASES = {"signals": SIGNALS, "timers": TIMERS, "timerfd-due": TIMERFD_DUE, "pty": PTY, "inotify": INOTIFY,
         "eventfd": EVENTFD, "tree": TREE}
