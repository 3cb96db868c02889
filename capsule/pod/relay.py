"""The relay to a capsule's pod layer: ``python3 -m pods …`` run through the guest agent's ``exec``,
its one JSON line parsed and its error kind raised as the typed error. Files (pod images) move on a disk
lent to the guest for the copy (:mod:`capsule.runtime.hotdisk`: ~15× the agent's channel under TCG), or,
where the guest takes no hot-plugged disk, in base64 chunks within the agent's limits (requests ≤ 64 KiB a
line, replies ≤ 8 MiB of output). Either way the copy is checked at both ends: in chunks by sha256, on a
lent disk by MD5 (:data:`DISK_CHECK`) — a check against damage on the way, not an authentication (the
guest wrote the bytes; the host seals what it got by its own sha256): sha256 costs the guest ~1 s per
60 MiB under TCG, MD5 a seventh of that. The guest writes to and reads from the lent disk with direct I/O
(no page cache to fill and flush)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import re
import secrets
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from capsule.errors import Conflict, NotFound
from capsule.pod.errors import BY_KIND, PodFailed, PodLayerMissing, PodLayerOutdated
from capsule.runtime.connection import lookup_domain
from capsule.runtime.guestagent import AgentError, AgentReplyInvalid, GuestAgent, exec_result
from capsule.runtime.hotdisk import HotDisk, HotDiskUnavailable, scratch_file
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from hashcache import wirejson

DOWN_CHUNK = 3 << 20      # raw bytes per read: 4 MiB of base64, under the agent's 8 MiB output cap
UP_CHUNK = 45 << 10       # raw bytes per write: 60 KiB of base64 in one request line (limit 64 KiB)
OUTPUT_CAP = 8 << 20
# Below these sizes the agent's channel is quicker than lending a disk (its attach, the guest noticing it,
# its detach: ~1–2 s under TCG); above, the disk wins more with every MiB (in: 1.6 MiB/s on the channel).
LEND_FROM_IN = 2 << 20
LEND_FROM_OUT = 16 << 20
Progress = Callable[[str], None] | None
_SHA256 = re.compile(r"([0-9a-f]{64})(?:\s.*)?", re.DOTALL)
DISK_CHECK = "md5"   # the transport check of a copy on a lent disk: the guest's md5sum, the host's hashlib
_MD5 = re.compile(r"([0-9a-f]{32})(?:\s.*)?", re.DOTALL)
DIRECT_BS = "4M"


def _instance(store: Store, capsule: str) -> InstanceRow:
    if store.catalogue.capsule(capsule) is None:
        raise NotFound(f"no capsule {capsule!r} in this store (see `capsule ls`)")
    inst = store.catalogue.instance(capsule)
    if inst is None:
        raise Conflict(f"capsule {capsule!r} is not running; pods live in running capsules (`capsule start`)")
    return inst


class Relay:
    """One capsule's pod layer, through its guest agent."""

    def __init__(self, store: Store, capsule: str) -> None:
        self.capsule = capsule
        self.store = store
        inst = _instance(store, capsule)
        self.sock = Path(inst.dir) / "agent.sock"
        self.domain = inst.domain
        self._agent: GuestAgent | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One agent connection for many calls: each new connection is a host (dis)connect the guest's
        agent notices by polling, and a request sent across one can be dropped (PROTOCOL.md)."""
        if self._agent is not None:
            yield
            return
        with GuestAgent(self.sock, timeout=10.0) as agent:
            self._agent = agent
            try:
                yield
            finally:
                self._agent = None

    def _exec(self, argv: list[str], timeout: float, stdin: str | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"argv": argv, "timeout_s": timeout, "max_output_bytes": OUTPUT_CAP}
        if stdin is not None:
            args["stdin"] = stdin
        with self.session():
            assert self._agent is not None
            try:
                reply = self._agent.call("exec", args, timeout=timeout + 5)
            except AgentError as exc:
                raise PodLayerMissing(f"capsule {self.capsule!r} has no pod layer ({exc}); pods need a guest "
                                      f"with python3 and pods/, such as the debian image") from exc
        return exec_result(reply, f"capsule {self.capsule!r}: {argv[0]}")

    def call(self, *argv: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Any:
        """``python3 -m pods ARGV…`` in the guest (with ``env`` added to its environment); its result, or its
        error raised as ours."""
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        r = self._exec([*prefix, "python3", "-m", "pods", *argv], timeout)
        if r.get("timed_out"):
            raise PodFailed(f"capsule {self.capsule!r}: pods {argv[0]} did not finish in {timeout:.0f} s")
        try:
            reply = wirejson.loads(r["stdout"].strip().splitlines()[-1])
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except (ValueError, IndexError):
            err = r["stderr"].strip()
            if r.get("exit_code") == 2 and ("unrecognized arguments" in err or "invalid choice" in err):
                raise PodLayerOutdated(f"capsule {self.capsule!r}: its pod layer does not offer pods "
                                       f"{' '.join(argv[:1])} as asked: {err.splitlines()[-1][-300:]}") from None
            if "No module named pods" in err or "No such file" in err:
                raise PodLayerMissing(f"capsule {self.capsule!r} has no pod layer (its image lacks pods/); "
                                      f"pods need a guest with python3 and pods/, such as the debian image") from None
            raise PodFailed(f"capsule {self.capsule!r}: pods {argv[0]} failed: {err[-500:]}") from None
        if reply.get("ok") is True:
            if "result" not in reply:
                raise AgentReplyInvalid(f"capsule {self.capsule!r}: pods {argv[0]}: the guest's reply has no result")
            return reply["result"]
        kind = reply.get("kind")
        cls = BY_KIND.get(kind, PodFailed) if isinstance(kind, str) else PodFailed
        raise cls(f"capsule {self.capsule!r}: {str(reply.get('error'))[:1000]}")

    def sh(self, script: str, timeout: float = 60.0, stdin: str | None = None) -> str:
        r = self._exec(["sh", "-c", script], timeout, stdin)
        if r.get("exit_code") != 0:
            raise PodFailed(f"capsule {self.capsule!r}: {script.split()[0]} failed: {r['stderr'][-500:]}")
        return r["stdout"]

    def sha256(self, guest_path: str, timeout: float = 60.0) -> str:
        """The sha256 of a file in the guest (``sha256sum``), checked to be one."""
        out = self.sh(f"sha256sum {shlex.quote(guest_path)}", timeout=timeout)
        return _digest(out, f"capsule {self.capsule!r}: sha256sum {guest_path}")

    def _has_device(self, device: str) -> bool:
        return self.sh(f"test -b {shlex.quote(device)} && echo yes || true").strip() == "yes"

    def _lend(self, path: Path, writable: bool) -> HotDisk:
        domain = lookup_domain(self.domain)
        if domain is None:
            raise HotDiskUnavailable(f"capsule {self.capsule!r}: its domain {self.domain} is gone")
        return HotDisk(domain, path, self._has_device, writable=writable)

    @contextlib.contextmanager
    def lent(self, path: Path, *, writable: bool) -> Iterator[str]:
        """``path`` lent to the guest as a disk for the block: its device's path in the guest."""
        lent = self._lend(path, writable)
        with self.session(), lent as disk:
            yield disk.guest_device

    def download(self, guest_path: str, size: int, dest: Path, progress: Progress = None, *,
                 lend: bool | None = None) -> int:
        """Copy a guest file here, on a lent disk (``lend``; by default from LEND_FROM_OUT bytes) or else
        through the agent; checked against the guest's sha256. Returns the agent calls the copy itself made
        (1 on a lent disk)."""
        if lend if lend is not None else size >= LEND_FROM_OUT:
            try:
                return self._download_disk(guest_path, size, dest, progress)
            except HotDiskUnavailable:
                if lend:
                    raise
        return self._download_chunks(guest_path, size, dest, progress)

    def _download_disk(self, guest_path: str, size: int, dest: Path, progress: Progress) -> int:
        q = shlex.quote(guest_path)
        scratch = scratch_file(self.sock.parent / f"lent-{secrets.token_hex(8)}.raw", size)  # where QEMU may reach
        try:
            lent = self._lend(scratch, writable=True)
            with self.session(), lent as disk:
                if progress:
                    progress(f"copying {size >> 10} KiB out on a lent disk")
                # direct writes (dd writes its last, short block through the cache: conv=fsync flushes it)
                theirs = _digest(self.sh(f"dd if={q} of={disk.guest_device} bs={DIRECT_BS} oflag=direct "
                                         f"conv=fsync status=none && md5sum {q}", timeout=600),
                                 f"capsule {self.capsule!r}: dd", _MD5)
            with scratch.open("r+b") as f:
                f.truncate(size)
            if _file_digest(scratch, DISK_CHECK) != theirs:
                raise PodFailed(f"capsule {self.capsule!r}: {guest_path} came out damaged on the lent disk")
            scratch.replace(dest)
        finally:
            scratch.unlink(missing_ok=True)
        return 1

    def _download_chunks(self, guest_path: str, size: int, dest: Path, progress: Progress = None) -> int:
        q = shlex.quote(guest_path)
        digest = hashlib.sha256()
        calls = 0
        with self.session(), dest.open("wb") as out:
            offset = 0
            while offset < size:
                ask = min(DOWN_CHUNK, size - offset)
                b64 = self.sh(f"dd if={q} bs=1M iflag=skip_bytes,count_bytes skip={offset} count={ask} "
                              f"status=none | base64 -w0", timeout=120)
                try:
                    raw = base64.b64decode(b64.strip(), validate=True)
                except binascii.Error:
                    raise AgentReplyInvalid(f"capsule {self.capsule!r}: {guest_path} at {offset}: the guest sent "
                                            "something other than base64") from None
                if len(raw) > ask:  # the file never grows past the size the host accepted
                    raise AgentReplyInvalid(f"capsule {self.capsule!r}: {guest_path} at {offset}: the guest sent "
                                            f"{len(raw)} bytes where {ask} were asked for")
                if not raw:
                    raise PodFailed(f"capsule {self.capsule!r}: {guest_path} ended at {offset} of {size} bytes")
                out.write(raw)
                digest.update(raw)
                offset += len(raw)
                calls += 1
                if progress:
                    progress(f"{offset >> 10} of {size >> 10} KiB")
            theirs = self.sha256(guest_path)
        if theirs != digest.hexdigest():
            raise PodFailed(f"capsule {self.capsule!r}: {guest_path} changed while it was copied")
        return calls

    def upload(self, src: Path, guest_path: str, progress: Progress = None, *, lend: bool | None = None) -> int:
        """Copy a file here into the guest (written to .part, renamed when checked), on a lent disk (``lend``;
        by default from LEND_FROM_IN bytes) or else through the agent. Returns the agent calls the copy
        itself made (1 on a lent disk)."""
        if lend if lend is not None else src.stat().st_size >= LEND_FROM_IN:
            try:
                return self._upload_disk(src, guest_path, progress)
            except HotDiskUnavailable:
                if lend:
                    raise
        return self._upload_chunks(src, guest_path, progress)

    def _upload_disk(self, src: Path, guest_path: str, progress: Progress) -> int:
        q = shlex.quote(guest_path)
        part = shlex.quote(guest_path + ".part")
        size = src.stat().st_size
        lent = self._lend(src, writable=False)
        with self.session(), lent as disk:
            if progress:
                progress(f"copying {size >> 10} KiB in on a lent disk")
            # whole sectors with direct reads (the disk is the file rounded up to a sector), then cut to size
            theirs = _digest(self.sh(f"mkdir -p $(dirname {q}) && dd if={disk.guest_device} of={part} "
                                     f"bs={DIRECT_BS} iflag=direct status=none && truncate -s {size} {part} && "
                                     f"md5sum {part}", timeout=600), f"capsule {self.capsule!r}: dd", _MD5)
        if theirs != _file_digest(src, DISK_CHECK):
            self.sh(f"rm -f {part}")
            raise PodFailed(f"capsule {self.capsule!r}: the pod image arrived damaged")
        self.sh(f"mv {part} {q}")
        return 1

    def _upload_chunks(self, src: Path, guest_path: str, progress: Progress = None) -> int:
        q = shlex.quote(guest_path)
        part = shlex.quote(guest_path + ".part")
        self.sh(f"mkdir -p $(dirname {q}) && : > {part}")
        digest = hashlib.sha256()
        calls = 0
        size = src.stat().st_size
        with self.session(), src.open("rb") as f:
            while chunk := f.read(UP_CHUNK):
                digest.update(chunk)
                self.sh(f"base64 -d >> {part}", stdin=base64.b64encode(chunk).decode())
                calls += 1
                if progress:
                    progress(f"{f.tell() >> 10} of {size >> 10} KiB")
            theirs = self.sha256(guest_path + ".part")
        if theirs != digest.hexdigest():
            raise PodFailed(f"capsule {self.capsule!r}: the pod image arrived damaged")
        self.sh(f"mv {part} {q}")
        return calls


def _digest(out: str, what: str, form: re.Pattern[str] = _SHA256) -> str:
    """The digest ``sha256sum`` (or ``md5sum``, with ``form`` ``_MD5``) printed (its first word)."""
    m = form.fullmatch(out.strip())
    if m is None:
        kind = "an md5" if form is _MD5 else "a sha256"
        raise AgentReplyInvalid(f"{what}: the guest printed {out[:80]!r}, not {kind} digest")
    return m[1]


def _file_digest(path: Path, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm, usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
