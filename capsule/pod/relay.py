"""The relay to a capsule's pod layer: ``python3 -m pods …`` run through the guest agent's ``exec``,
its one JSON line parsed and its error kind raised as the typed error; files moved in base64 chunks
within the agent's limits (requests ≤ 64 KiB a line, replies ≤ 8 MiB of output)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from capsule.errors import Conflict, NotFound
from capsule.pod.errors import BY_KIND, PodFailed, PodLayerMissing
from capsule.runtime.guestagent import AgentError, GuestAgent
from capsule.store import Store
from hashcache import wirejson

DOWN_CHUNK = 3 << 20      # raw bytes per read: 4 MiB of base64, under the agent's 8 MiB output cap
UP_CHUNK = 45 << 10       # raw bytes per write: 60 KiB of base64 in one request line (limit 64 KiB)
OUTPUT_CAP = 8 << 20
Progress = Callable[[str], None] | None


def agent_socket(store: Store, capsule: str) -> Path:
    if store.catalogue.capsule(capsule) is None:
        raise NotFound(f"no capsule {capsule!r} in this store (see `capsule ls`)")
    inst = store.catalogue.instance(capsule)
    if inst is None:
        raise Conflict(f"capsule {capsule!r} is not running; pods live in running capsules (`capsule start`)")
    return Path(inst.dir) / "agent.sock"


class Relay:
    """One capsule's pod layer, through its guest agent."""

    def __init__(self, store: Store, capsule: str) -> None:
        self.capsule = capsule
        self.sock = agent_socket(store, capsule)
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
                return self._agent.call("exec", args, timeout=timeout + 5)
            except AgentError as exc:
                raise PodLayerMissing(f"capsule {self.capsule!r} has no pod layer ({exc}); pods need a guest "
                                      f"with python3 and pods/, such as the debian image") from exc

    def call(self, *argv: str, timeout: float = 60.0) -> Any:
        """``python3 -m pods ARGV…`` in the guest; its result, or its error raised as ours."""
        r = self._exec(["python3", "-m", "pods", *argv], timeout)
        if r.get("timed_out"):
            raise PodFailed(f"capsule {self.capsule!r}: pods {argv[0]} did not finish in {timeout:.0f} s")
        try:
            reply = wirejson.loads(r["stdout"].strip().splitlines()[-1])
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except (ValueError, IndexError, AttributeError):
            err = r.get("stderr", "").strip()
            if "No module named pods" in err or "No such file" in err:
                raise PodLayerMissing(f"capsule {self.capsule!r} has no pod layer (its image lacks pods/); "
                                      f"pods need a guest with python3 and pods/, such as the debian image") from None
            raise PodFailed(f"capsule {self.capsule!r}: pods {argv[0]} failed: {err[-500:]}") from None
        if reply.get("ok"):
            return reply["result"]
        cls = BY_KIND.get(reply.get("kind"), PodFailed)
        raise cls(f"capsule {self.capsule!r}: {reply.get('error')}")

    def sh(self, script: str, timeout: float = 60.0, stdin: str | None = None) -> str:
        r = self._exec(["sh", "-c", script], timeout, stdin)
        if r.get("exit_code") != 0:
            raise PodFailed(f"capsule {self.capsule!r}: {script.split()[0]} failed: {r.get('stderr', '')[-500:]}")
        return r["stdout"]

    def download(self, guest_path: str, size: int, dest: Path, progress: Progress = None) -> int:
        """Copy a guest file here in chunks; checked against the guest's sha256. Returns exec calls made."""
        q = shlex.quote(guest_path)
        digest = hashlib.sha256()
        calls = 0
        with self.session(), dest.open("wb") as out:
            offset = 0
            while offset < size:
                b64 = self.sh(f"dd if={q} bs=1M iflag=skip_bytes,count_bytes skip={offset} count={DOWN_CHUNK} "
                              f"status=none | base64 -w0", timeout=120)
                raw = base64.b64decode(b64)
                if not raw:
                    raise PodFailed(f"capsule {self.capsule!r}: {guest_path} ended at {offset} of {size} bytes")
                out.write(raw)
                digest.update(raw)
                offset += len(raw)
                calls += 1
                if progress:
                    progress(f"{offset >> 10} of {size >> 10} KiB")
            theirs = self.sh(f"sha256sum {q}").split()[0]
        if theirs != digest.hexdigest():
            raise PodFailed(f"capsule {self.capsule!r}: {guest_path} changed while it was copied")
        return calls

    def upload(self, src: Path, guest_path: str, progress: Progress = None) -> int:
        """Copy a file here into the guest in chunks (written to .part, renamed when checked)."""
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
            theirs = self.sh(f"sha256sum {part}").split()[0]
        if theirs != digest.hexdigest():
            raise PodFailed(f"capsule {self.capsule!r}: the pod image arrived damaged")
        self.sh(f"mv {part} {q}")
        return calls
