"""The guest agent (guest-balloon/*.c), built with make and run on the host.

The agent normally talks over a virtio-serial port inside a guest; here it runs
with --stdio, on a pty (--device) and on a unix socket (--device), which
exercise the same request loop.  Nothing here freezes a real file system.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import time
import tty
from pathlib import Path

import pytest

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "guest-balloon"
MiB = 1024 * 1024


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    subprocess.run(["make", "-C", str(AGENT_DIR)], check=True, capture_output=True, text=True)
    path = AGENT_DIR / "capsule-agent"
    assert path.is_file()
    return path


class LineReader:
    """Reads JSON lines from a file descriptor with a deadline (never hangs a test)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def readline(self, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply line within {timeout} s (have {self.buf[:200]!r})")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise EOFError("agent closed its output")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line


class Agent:
    def __init__(self, write_fd: int, read_fd: int):
        self.write_fd = write_fd
        self.reader = LineReader(read_fd)
        self.next_id = 1

    def send_raw(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self.write_fd], [], 10)
            assert ready, "agent does not read its input"
            n = os.write(self.write_fd, view[:65536])
            view = view[n:]

    def reply(self, timeout: float = 10.0) -> dict:
        return json.loads(self.reader.readline(timeout))

    def call(self, cmd: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        rid = self.next_id
        self.next_id += 1
        req = {"id": rid, "cmd": cmd}
        if args is not None:
            req["args"] = args
        self.send_raw(json.dumps(req).encode() + b"\n")
        rep = self.reply(timeout)
        assert rep["id"] == rid, rep
        return rep

    def ok(self, cmd: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        rep = self.call(cmd, args, timeout)
        assert rep["ok"] is True, rep
        return rep["result"]


@pytest.fixture
def stdio_agent(agent_bin):
    proc = subprocess.Popen(
        [str(agent_bin), "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    agent = Agent(proc.stdin.fileno(), proc.stdout.fileno())
    agent.proc = proc
    try:
        yield agent
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


# --------------------------------------------------------------------------- build


def test_binary_is_small_and_static(agent_bin):
    data = agent_bin.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert len(data) < 1024 * 1024
    # no PT_INTERP program header: nothing to load, runs in a bare initramfs
    phoff, phentsize, phnum = struct.unpack_from("<Q", data, 0x20)[0], *struct.unpack_from("<HH", data, 0x36)
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    assert 3 not in types
    assert 2 not in types  # nor PT_DYNAMIC


def test_version_and_help(agent_bin):
    v = subprocess.run([str(agent_bin), "--version"], capture_output=True, text=True, timeout=5)
    assert v.returncode == 0 and v.stdout.startswith("capsule-agent ")
    h = subprocess.run([str(agent_bin), "--help"], capture_output=True, text=True, timeout=5)
    assert h.returncode == 0 and "--device" in h.stdout and "--stdio" in h.stdout
    bad = subprocess.run([str(agent_bin), "--bogus"], capture_output=True, text=True, timeout=5)
    assert bad.returncode == 2


# --------------------------------------------------------------------------- protocol


def test_ping(stdio_agent):
    r = stdio_agent.ok("ping")
    assert r["pid"] == stdio_agent.proc.pid
    assert isinstance(r["version"], str) and r["version"]
    assert r["uptime"] >= 0
    assert "balloon.inflate" in r["commands"]


def test_string_ids_are_echoed(stdio_agent):
    stdio_agent.send_raw(b'{"id": "abc", "cmd": "ping"}\n')
    rep = stdio_agent.reply()
    assert rep["id"] == "abc" and rep["ok"] is True


def test_stats_match_host_meminfo(stdio_agent):
    r = stdio_agent.ok("stats")
    host = _meminfo()
    for key in ("MemTotal", "MemFree", "MemAvailable", "Cached", "Buffers", "SwapTotal", "SwapFree"):
        assert isinstance(r[key], int) and r[key] >= 0, key
    assert r["MemTotal"] == host["MemTotal"]
    assert r["SwapTotal"] == host["SwapTotal"]
    assert 0 < r["MemAvailable"] <= r["MemTotal"]
    assert r["MemFree"] <= r["MemTotal"]
    assert abs(r["MemAvailable"] - host["MemAvailable"]) < max(512 * MiB, host["MemTotal"] // 8)
    assert r["balloon_held_bytes"] == 0


@pytest.mark.parametrize(
    "line, expected_id, fragment",
    [
        (b"this is not json", None, "malformed JSON"),
        (b'{"id": 1, "cmd": "ping"', None, "malformed JSON"),
        (b'{"id": 1, "cmd": "ping"} trailing', None, "malformed JSON"),
        (b'{"id": 1, "cmd": "ping", "x": "\x01"}', None, "malformed JSON"),
        (b"[1, 2, 3]", None, "must be a JSON object"),
        (b'"ping"', None, "must be a JSON object"),
        (b'{"id": [1], "cmd": "ping"}', None, "id"),
        (b'{"id": 7}', 7, "cmd"),
        (b'{"id": 8, "cmd": 5}', 8, "cmd"),
        (b'{"id": 9, "cmd": "no.such.command"}', 9, "unknown command"),
        (b'{"id": 10, "cmd": "stats", "args": [1]}', 10, "args"),
        (b'{"id": 11, "cmd": "balloon.inflate", "args": {"max_byte": 1}}', 11, "unknown argument"),
        (b'{"id": 12, "cmd": "exec", "args": {"argv": []}}', 12, "argv"),
        (b'{"id": 13, "cmd": "exec", "args": {"argv": "ls"}}', 13, "argv"),
    ],
)
def test_bad_requests_get_error_replies(stdio_agent, line, expected_id, fragment):
    stdio_agent.send_raw(line + b"\n")
    rep = stdio_agent.reply()
    assert rep["ok"] is False
    assert rep["id"] == expected_id
    assert fragment in rep["error"], rep
    # the agent is still there
    assert stdio_agent.ok("ping")["pid"] == stdio_agent.proc.pid


def test_empty_strings_stay_empty_after_the_heap_held_others(stdio_agent):
    """Regression (found by the fuzzer, guest-balloon/fuzz/regressions/empty-key-not-terminated): the
    JSON string "" was decoded into a buffer never NUL-terminated, so an empty key, command or argument
    read whatever the heap held before (out of bounds under AddressSanitizer)."""
    for n in range(20):  # leave freed buffers full of 'x' behind
        stdio_agent.send_raw(json.dumps({"id": n, "cmd": "x" * 200, "args": {"y" * 200: "z" * 200}}).encode()
                             + b"\n")
        assert stdio_agent.reply()["ok"] is False
    assert stdio_agent.call("", None)["error"] == "unknown command ''"
    assert stdio_agent.call("balloon.deflate", {"": 1})["error"] == "unknown argument ''"
    rep = stdio_agent.ok("exec", {"argv": ["cat"], "stdin": ""})
    assert rep["stdout"] == "" and rep["exit_code"] == 0


def test_oversized_line_is_discarded(stdio_agent):
    big = b'{"id": 1, "cmd": "ping", "pad": "' + b"x" * (100 * 1024) + b'"}\n'
    stdio_agent.send_raw(big + b"\n")  # plus a blank line, which is ignored silently
    rep = stdio_agent.reply()
    assert rep == {"id": None, "ok": False, "error": rep["error"]}
    assert "too long" in rep["error"]
    # the rest of the oversized line was dropped: the next reply is for the next request
    assert stdio_agent.ok("ping")["pid"] == stdio_agent.proc.pid


def test_line_just_under_the_limit_is_accepted(stdio_agent):
    head = b'{"id": 5, "cmd": "ping", "pad": "'
    tail = b'"}'
    line = head + b"y" * (65536 - len(head) - len(tail)) + tail
    assert len(line) == 65536
    stdio_agent.send_raw(line + b"\n")
    rep = stdio_agent.reply()
    assert rep["id"] == 5 and rep["ok"] is True
    stdio_agent.send_raw(b'{"id": 6, "cmd": "ping"}\r\n')  # CRLF is fine too
    assert stdio_agent.reply()["id"] == 6


def test_json_escapes_round_trip(stdio_agent):
    text = 'quote " backslash \\ tab \t nl \n ctl \x01 é 😀'
    r = stdio_agent.ok("exec", {"argv": ["printf", "%s", text]})
    assert r["stdout"] == text
    # invalid UTF-8 from the command becomes U+FFFD, and the reply stays valid JSON
    r = stdio_agent.ok("exec", {"argv": ["sh", "-c", r"printf 'a\377b\303\251\342\202'"]})
    assert r["stdout"] == "a\ufffdbé\ufffd\ufffd"


# --------------------------------------------------------------------------- balloon


def test_balloon_inflate_and_deflate(stdio_agent):
    pid = stdio_agent.proc.pid
    oom_before = Path(f"/proc/{pid}/oom_score_adj").read_text().strip()
    rss0 = _status_kib(pid, "VmRSS") * 1024
    r = stdio_agent.ok(
        "balloon.inflate", {"policy": "none", "max_bytes": 64 * MiB, "floor_bytes": 32 * MiB}, timeout=30
    )
    assert r["stop_reason"] == "max_bytes", r
    assert r["held_bytes"] == 64 * MiB
    assert r["seconds"] < 10
    rss1 = _status_kib(pid, "VmRSS") * 1024
    # every page was written, so it is resident (not the shared zero page)
    assert rss1 - rss0 >= 60 * MiB, (rss0, rss1)
    status = stdio_agent.ok("balloon.status")
    assert status["held_bytes"] == 64 * MiB
    assert status["oom_score_adj"] == 1000
    assert stdio_agent.ok("stats")["balloon_held_bytes"] == 64 * MiB

    d = stdio_agent.ok("balloon.deflate")
    assert d["released_bytes"] == 64 * MiB
    rss2 = _status_kib(pid, "VmRSS") * 1024
    assert rss2 < rss0 + 8 * MiB, (rss0, rss2)
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == oom_before
    assert stdio_agent.ok("balloon.status")["held_bytes"] == 0
    assert stdio_agent.ok("balloon.deflate")["released_bytes"] == 0


def test_balloon_floor_stops_inflation(stdio_agent):
    # a floor above all memory: the stop rule fires before anything is allocated
    r = stdio_agent.ok("balloon.inflate", {"policy": "none", "floor_bytes": 1 << 50})
    assert r["stop_reason"] == "floor"
    assert r["held_bytes"] == 0


def test_balloon_partial_deflate(stdio_agent):
    stdio_agent.ok("balloon.inflate", {"max_bytes": 16 * MiB, "step_bytes": 4 * MiB})
    d = stdio_agent.ok("balloon.deflate", {"bytes": 6 * MiB})
    assert d["released_bytes"] == 8 * MiB and d["held_bytes"] == 8 * MiB
    assert stdio_agent.ok("balloon.deflate")["released_bytes"] == 8 * MiB


def test_balloon_bad_policy(stdio_agent):
    rep = stdio_agent.call("balloon.inflate", {"policy": "everything"})
    assert rep["ok"] is False and "policy" in rep["error"]


# --------------------------------------------------------------------------- exec


def test_exec_echo(stdio_agent):
    r = stdio_agent.ok("exec", {"argv": ["echo", "hi"], "timeout_s": 10})
    assert r["stdout"] == "hi\n"
    assert r["stderr"] == ""
    assert r["exit_code"] == 0 and r["signal"] is None and r["timed_out"] is False


def test_exec_exit_code_and_stderr(stdio_agent):
    r = stdio_agent.ok("exec", {"argv": ["sh", "-c", "echo oops >&2; exit 3"]})
    assert r["exit_code"] == 3
    assert r["stderr"] == "oops\n"
    assert r["timed_out"] is False


def test_exec_stdin(stdio_agent):
    r = stdio_agent.ok("exec", {"argv": ["cat"], "stdin": "line one\nline two\n"})
    assert r["stdout"] == "line one\nline two\n"


def test_exec_timeout_kills_the_process_group(stdio_agent):
    t0 = time.monotonic()
    r = stdio_agent.ok("exec", {"argv": ["sh", "-c", "sleep 5; echo late"], "timeout_s": 1}, timeout=10)
    assert r["timed_out"] is True
    assert r["exit_code"] is None and r["signal"] == 9
    assert "late" not in r["stdout"]
    assert time.monotonic() - t0 < 4


def test_exec_sleep_timeout(stdio_agent):
    r = stdio_agent.ok("exec", {"argv": ["sleep", "5"], "timeout_s": 1}, timeout=10)
    assert r["timed_out"] is True


def test_exec_missing_program(stdio_agent):
    rep = stdio_agent.call("exec", {"argv": ["/nonexistent/program"]})
    assert rep["ok"] is False and "No such file" in rep["error"]


def test_exec_output_cap(stdio_agent):
    r = stdio_agent.ok("exec", {"argv": ["head", "-c", "2000000", "/dev/zero"], "max_output_bytes": 1000})
    assert len(r["stdout"]) == 1000 and r["stdout_truncated"] is True
    assert set(r["stdout"]) == {"\x00"}


# --------------------------------------------------------------------------- fs


def test_fs_freeze_empty_list_freezes_nothing(stdio_agent):
    r = stdio_agent.ok("fs.freeze", {"mounts": [], "timeout_s": 5})
    assert r["frozen"] == []
    assert stdio_agent.ok("fs.status") == {"frozen": [], "thaw_in_s": None}
    assert stdio_agent.ok("fs.thaw", {"mounts": []})["thawed"] == []


def test_fs_freeze_missing_mount_is_an_error(stdio_agent):
    rep = stdio_agent.call("fs.freeze", {"mounts": ["/nonexistent/mount/point"], "timeout_s": 5})
    assert rep["ok"] is False
    assert stdio_agent.ok("fs.status")["frozen"] == []


# --------------------------------------------------------------------------- transports


def test_stdin_eof_exits_cleanly(agent_bin):
    proc = subprocess.run(
        [str(agent_bin), "--stdio"], input=b'{"id": 1, "cmd": "ping"}\n', capture_output=True, timeout=10
    )
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["ok"] is True


def test_pty_device_and_hangup(agent_bin):
    master, slave = os.openpty()
    tty.setraw(slave)  # no echo / line editing before the agent sets raw mode itself
    path = os.ttyname(slave)
    proc = subprocess.Popen([str(agent_bin), "--device", path], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        agent = Agent(master, master)
        # keep our slave fd until the agent has the pty open (the master reads EIO while no slave is open)
        assert agent.ok("ping")["pid"] == proc.pid
        os.close(slave)
        slave = -1
        agent.send_raw(b"garbage\n")
        assert agent.reply()["ok"] is False
        assert agent.ok("exec", {"argv": ["echo", "hi"]})["stdout"] == "hi\n"
        # a 100 KiB line through the tty: no canonical-mode 4 KiB limit
        agent.send_raw(b"{" + b" " * (100 * 1024) + b"}\n")
        assert "too long" in agent.reply()["error"]
        assert agent.ok("ping")["pid"] == proc.pid

        # the host side goes away: the agent must neither exit nor spin
        cpu0 = _cpu_seconds(proc.pid)
        os.close(master)
        master = -1
        time.sleep(1.5)
        assert proc.poll() is None, "agent exited after hangup"
        assert _cpu_seconds(proc.pid) - cpu0 < 0.2
    finally:
        for fd in (master, slave):
            if fd >= 0:
                os.close(fd)
        proc.terminate()
        proc.wait(timeout=5)
        proc.stderr.close()


def test_unix_socket_device_reconnects(agent_bin, tmp_path):
    sock_path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)
    srv.settimeout(10)
    proc = subprocess.Popen([str(agent_bin), "--device", str(sock_path)], stderr=subprocess.PIPE)
    try:
        for round_ in range(3):
            conn, _ = srv.accept()
            with conn:
                agent = Agent(conn.fileno(), conn.fileno())
                agent.next_id = 100 * round_
                agent.send_raw(b"\n")  # resynchronise: a blank line is ignored
                assert agent.ok("ping")["pid"] == proc.pid
        # no host listening any more: the agent keeps retrying quietly
        srv.close()
        cpu0 = _cpu_seconds(proc.pid)
        time.sleep(1)
        assert proc.poll() is None
        assert _cpu_seconds(proc.pid) - cpu0 < 0.2
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        proc.stderr.close()


def test_device_at_eof_does_not_spin(agent_bin):
    """/dev/null reads EOF forever, like a virtio-serial port with no host connected."""
    proc = subprocess.Popen([str(agent_bin), "--device", "/dev/null"], stderr=subprocess.PIPE)
    try:
        time.sleep(0.3)
        cpu0 = _cpu_seconds(proc.pid)
        time.sleep(1)
        assert proc.poll() is None
        assert _cpu_seconds(proc.pid) - cpu0 < 0.1
    finally:
        proc.terminate()
        assert proc.wait(timeout=5) == 0
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert "host not connected" in err
    assert err.count("host not connected") == 1  # logged once, not once per retry


def test_device_that_appears_later(agent_bin, tmp_path):
    sock_path = tmp_path / "late.sock"
    proc = subprocess.Popen([str(agent_bin), "--device", str(sock_path)], stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(sock_path))
        srv.listen(1)
        srv.settimeout(10)
        conn, _ = srv.accept()
        with conn, srv:
            agent = Agent(conn.fileno(), conn.fileno())
            assert agent.ok("ping")["pid"] == proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        proc.stderr.close()


def test_sigterm_releases_the_balloon(agent_bin):
    proc = subprocess.Popen(
        [str(agent_bin), "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        agent = Agent(proc.stdin.fileno(), proc.stdout.fileno())
        assert agent.ok("balloon.inflate", {"max_bytes": 8 * MiB})["held_bytes"] == 8 * MiB
        proc.terminate()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
