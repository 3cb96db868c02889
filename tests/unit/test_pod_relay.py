"""The host's relay to the pod layer, against a fake guest agent: each error kind the guest reports
comes back as its typed error, a guest without the pod layer says so, and files cross in chunks
that keep to the agent's request-line limit and are checked end to end."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from capsule.errors import CapsuleError, IntegrityError
from capsule.pod import errors as perr
from capsule.pod.relay import UP_CHUNK, Relay
from capsule.runtime.hotdisk import HotDiskUnavailable
from tests.helpers.fakeagent import reply, requests

pytestmark = pytest.mark.unit
LINE_LIMIT = 65536  # the agent's request line limit (guest-balloon/PROTOCOL.md)


def _fake(tmp_path: Path, answer: Callable[[dict[str, Any]], dict[str, Any]], seen: list) -> Relay:
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(8)

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            seen.append("connect")
            with conn:
                for req, n in requests(conn):
                    if req["cmd"] == "ping":  # the host confirms a fresh connection first
                        reply(conn, req["id"], {})
                        continue
                    seen.append(n)
                    reply(conn, req["id"], answer(req["args"]))

    threading.Thread(target=serve, daemon=True).start()
    relay = Relay.__new__(Relay)
    relay.capsule, relay.sock, relay._agent = "deb", path, None
    relay.store = SimpleNamespace(temp_path=lambda suffix: tmp_path / f"tmp{suffix}")  # type: ignore[assignment]

    def no_disk(_path: Path, writable: bool) -> None:  # a guest that takes no hot-plugged disk
        raise HotDiskUnavailable("the guest did not see a hot-plugged disk")

    relay._lend = no_disk  # type: ignore[method-assign]
    return relay


def _exec(stdout: str = "", stderr: str = "", code: int = 0) -> dict[str, Any]:
    return {"exit_code": code, "stdout": stdout, "stderr": stderr, "timed_out": False}


@pytest.mark.parametrize(("kind", "cls"), sorted(perr.BY_KIND.items()))
def test_each_guest_error_kind_is_raised_as_its_class(tmp_path, kind, cls):
    reply = json.dumps({"ok": False, "kind": kind, "error": "it went wrong"})
    relay = _fake(tmp_path, lambda _a: _exec(reply + "\n", code=3), [])
    with pytest.raises(cls, match="capsule 'deb': it went wrong") as err:
        relay.call("show", "web")
    assert isinstance(err.value, CapsuleError)
    assert cls is IntegrityError or err.value.code.startswith("pod_")


def test_result_and_arguments_go_through(tmp_path):
    asked = []

    def answer(args):
        asked.append(args["argv"])
        return _exec(json.dumps({"ok": True, "result": {"name": "web"}}) + "\n")

    relay = _fake(tmp_path, answer, [])
    assert relay.call("show", "web") == {"name": "web"}
    assert asked == [["python3", "-m", "pods", "show", "web"]]


def test_a_guest_without_the_pod_layer_says_so(tmp_path):
    relay = _fake(tmp_path, lambda _a: _exec("", "/usr/bin/python3: No module named pods\n", 1), [])
    with pytest.raises(perr.PodLayerMissing, match="no pod layer"):
        relay.call("ls")


def test_upload_without_a_lent_disk_keeps_to_the_line_limit_and_checks_the_digest(tmp_path):
    data = bytes(range(256)) * ((3 * UP_CHUNK) // 256 + 7)
    src = tmp_path / "image"
    src.write_bytes(data)
    got = bytearray()
    sizes: list[int] = []

    def answer(args):
        script = args["argv"][-1]
        if script.startswith("base64 -d"):
            got.extend(base64.b64decode(args["stdin"]))
        if script.startswith("sha256sum"):
            return _exec(hashlib.sha256(bytes(got)).hexdigest() + "  x\n")
        return _exec()

    relay = _fake(tmp_path, answer, sizes)
    calls = relay.upload(src, "/var/lib/pods/in/x.tar.zst")
    assert bytes(got) == data
    assert calls == -(-len(data) // UP_CHUNK)
    assert max(n for n in sizes if n != "connect") < LINE_LIMIT
    # the chunks and the check share one agent connection (the mkdir before and the rename after have theirs)
    assert sizes.count("connect") == 3


def test_upload_that_arrives_damaged_is_refused(tmp_path):
    src = tmp_path / "image"
    src.write_bytes(b"x" * 1000)

    def answer(args):
        if args["argv"][-1].startswith("sha256sum"):
            return _exec("0" * 64 + "  x\n")
        return _exec()

    with pytest.raises(perr.PodFailed, match="damaged"):
        _fake(tmp_path, answer, []).upload(src, "/var/lib/pods/in/x")


def test_download_without_a_lent_disk_reassembles_chunks_and_checks_the_digest(tmp_path):
    data = b"pod image " * 5000

    def answer(args):
        script = args["argv"][-1]
        if script.startswith("dd "):
            skip = int(script.split("skip=")[1].split()[0])
            count = 20000  # a guest that sends less than asked: the relay goes on from where it got
            return _exec(base64.b64encode(data[skip:skip + count]).decode())
        return _exec(hashlib.sha256(data).hexdigest() + "  x\n")

    dest = tmp_path / "out"
    calls = _fake(tmp_path, answer, []).download("/x", len(data), dest)
    assert dest.read_bytes() == data and calls == -(-len(data) // 20000)


def test_a_lent_disk_is_tried_by_size_and_a_guest_without_one_falls_back_unless_asked(tmp_path):
    from capsule.pod.relay import LEND_FROM_IN

    src = tmp_path / "big"
    src.write_bytes(os.urandom(LEND_FROM_IN))
    got = bytearray()
    tried: list[bool] = []

    def answer(args):
        script = args["argv"][-1]
        if script.startswith("base64 -d"):
            got.extend(base64.b64decode(args["stdin"]))
        if script.startswith("sha256sum"):
            return _exec(hashlib.sha256(bytes(got)).hexdigest() + "  x\n")
        return _exec()

    relay = _fake(tmp_path, answer, [])
    plain_lend = relay._lend

    def lend(path, writable):
        tried.append(writable)
        return plain_lend(path, writable)

    relay._lend = lend  # type: ignore[method-assign]
    assert relay.upload(src, "/var/lib/pods/in/big") > 1 and bytes(got) == src.read_bytes()
    assert tried == [False]  # big enough to try a lent disk; the guest took none: the channel carried it
    small = tmp_path / "small"
    small.write_bytes(b"s" * 1000)
    got.clear()
    relay.upload(small, "/var/lib/pods/in/small")
    assert tried == [False] and bytes(got) == b"s" * 1000  # too small to lend a disk for
    with pytest.raises(HotDiskUnavailable):
        relay.upload(small, "/var/lib/pods/in/small", lend=True)  # asked for: no silent fallback


class _LentDisk:
    """A lent disk the fake guest reaches as ``guest_device``: the host's file itself."""

    def __init__(self, path: Path, lent: list[tuple[Path, bool]], writable: bool) -> None:
        self.path, self.guest_device = path, f"/dev/disk/by-id/virtio-{path.name}"
        lent.append((path, writable))

    def __enter__(self) -> _LentDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _lending(tmp_path: Path, guest: Callable[[str, Path], str]) -> tuple[Relay, list[str]]:
    """A relay whose guest takes lent disks: ``guest(script, disk)`` plays the guest's shell."""
    scripts: list[str] = []
    lent: list[tuple[Path, bool]] = []

    def answer(args):
        script = args["argv"][-1]
        scripts.append(script)
        return _exec(guest(script, lent[-1][0]) if lent else "")

    relay = _fake(tmp_path, answer, [])
    relay._lend = lambda path, writable: _LentDisk(path, lent, writable)  # type: ignore[method-assign]
    return relay, scripts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damaged", [False, True])
def test_a_copy_out_on_a_lent_disk_is_written_direct_and_checked_by_md5(tmp_path, damaged):
    """The guest writes the image onto the lent disk with direct I/O and answers its md5 (sha256 costs a
    TCG guest ~1 s per 60 MiB); bytes that arrive other than the guest sent them are refused."""
    data = os.urandom(3 << 20) + b"tail"

    def guest(script: str, disk: Path) -> str:
        if not script.startswith("dd "):
            return ""
        with disk.open("r+b") as f:
            f.write(data if not damaged else data[:100] + b"X" + data[101:])
        return hashlib.md5(data).hexdigest() + "  /x\n"

    relay, scripts = _lending(tmp_path, guest)
    dest = tmp_path / "out"
    if damaged:
        with pytest.raises(perr.PodFailed, match="damaged"):
            relay.download("/x", len(data), dest, lend=True)
        assert not dest.exists()
    else:
        assert relay.download("/x", len(data), dest, lend=True) == 1
        assert dest.read_bytes() == data
    copy = next(s for s in scripts if s.startswith("dd "))
    assert "oflag=direct" in copy and "md5sum /x" in copy and "sha256sum" not in copy
    assert not list(tmp_path.glob("lent-*"))  # the scratch file goes either way


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damaged", [False, True])
def test_a_copy_in_on_a_lent_disk_is_read_direct_cut_to_size_and_checked_by_md5(tmp_path, damaged):
    src = tmp_path / "image"
    src.write_bytes(os.urandom((2 << 20) + 77))
    landed = bytearray()

    def guest(script: str, disk: Path) -> str:
        if "dd if=" not in script:
            return ""
        assert "iflag=direct" in script and f"truncate -s {src.stat().st_size} " in script
        landed[:] = disk.read_bytes()
        got = bytes(landed) if not damaged else b"other"
        return hashlib.md5(got).hexdigest() + "  x.part\n"

    relay, scripts = _lending(tmp_path, guest)
    if damaged:
        with pytest.raises(perr.PodFailed, match="damaged"):
            relay.upload(src, "/var/lib/pods/in/x.pod", lend=True)
        assert scripts[-1].startswith("rm -f ") and not any(s.startswith("mv ") for s in scripts)
    else:
        assert relay.upload(src, "/var/lib/pods/in/x.pod", lend=True) == 1
        assert bytes(landed) == src.read_bytes() and scripts[-1].startswith("mv ")
    assert not any("sha256sum" in s for s in scripts)
