"""Fault scenarios on real transfers (no guest), shared by the fault tests and ``bench.faults``.

Each scenario pushes or pulls a version whose newest layer holds ``size`` random bytes between two
stores, one behind a real ``capsule serve`` (capsule/agent/launch.py) speaking TLS with its own host key
(every client pins its certificate's fingerprint, as between hosts) and, where the link is at fault, behind
:class:`testkit.faultproxy.FaultProxy`. It injects its fault, checks the after-conditions (both
stores verify clean, nothing of the object installed before its commit, the transfer completes on a
rerun) and returns an :class:`Outcome`: faults injected and survived, block bytes sent again after the
fault and the bytes that were missing at the receiver when it happened."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from capsule import capsules, transfer
from capsule.agent.launch import AgentProcess
from capsule.agentclient import AgentClient
from capsule.store import Store
from capsule.store.objectio import has_object, object_manifest, open_shadow
from capsule.verify import verify
from hashcache.blocks import BLOCK_SIZE
from hashcache.transport import RetryPolicy
from testkit.faultproxy import FaultProxy
from testkit.fleetkit import new_version

MiB = 1 << 20


@dataclass
class Outcome:
    kind: str
    injected: int = 0
    survived: int = 0
    resent: int = 0     # block bytes sent after the faults
    missing: int = 0    # block bytes the receiver lacked when they struck
    detail: str = ""    # the error the user saw
    missed: int = 0     # kill draws that would have landed outside a transfer (drawn again, not counted)
    worst: int = 0      # the most one fault's resend exceeded what was missing then (bytes; may be < 0)

    @property
    def ratio(self) -> float:
        return self.resent / self.missing if self.missing else 0.0


def sound(store: Store) -> list[str]:
    """What is wrong with ``store`` after a fault: verify problems, and versions recorded whose layers are
    not installed (half-installed)."""
    problems = [f"{p.kind} {p.id[:12]}: {p.error}" for p in verify(store).problems]
    for v in store.catalogue.versions():
        problems += [f"{v.ref}: layer {lid[:12]} is not installed"
                     for chain in v.chains for lid in chain if not has_object(store, "layer", lid)]
    return problems


def make_pair(tmp: Path, images: Store, size: int, seed: int = 1) -> tuple[Store, Store]:
    """Store A holding capsule ``cap`` whose latest version adds a layer of ``size`` random bytes, and an
    empty store B holding the tiny image."""
    a = Store.open(tmp / "a")
    b = Store.open(tmp / "b")
    from capsule import images as imgs

    for s in (a, b):
        imgs.import_image(images, s, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    new_version(a, "cap", size, seed)
    return a, b


def top_layer(store: Store, name: str = "cap") -> str:
    v = store.catalogue.latest_version(name)
    assert v is not None
    return v.chains[0][-1]


def arrived(receiver: Store, sender: Store, lid: str) -> int:
    """Bytes of layer ``lid`` the receiver already holds: its whole size once installed, else what its
    shadow kept of an interrupted receive."""
    m = object_manifest(sender, "layer", lid)
    if has_object(receiver, "layer", lid):
        return m.nonzero_blocks * BLOCK_SIZE
    with open_shadow(receiver, "layer", m) as shadow:
        return shadow.present_count() * BLOCK_SIZE


@contextmanager
def short_client(timeout: float = 3.0, tries: int = 1) -> Iterator[None]:
    """Clients made meanwhile give up fast: ``timeout`` per call, ``tries`` retries of 0.2 s."""
    kw = AgentClient.__init__.__kwdefaults__
    assert kw is not None   # (its keyword-only parameters have defaults)
    saved = dict(kw)
    kw.update(retry=RetryPolicy(delays=(0.2,) * tries))
    defaults = AgentClient.__init__.__defaults__
    AgentClient.__init__.__defaults__ = (timeout,)
    try:
        yield
    finally:
        kw.clear()
        kw.update(saved)
        AgentClient.__init__.__defaults__ = defaults


def agent(home: Path, port: int | None = None, **env: str) -> AgentProcess:
    """``capsule serve`` for ``home`` with TLS on its host key (``.fingerprint`` is its pin)."""
    import os

    return AgentProcess(home, home.parent / f"{home.name}.token", port, env={**os.environ, **env} if env else None,
                        tls=True)


def kill(proc: subprocess.Popen | AgentProcess) -> None:
    """SIGKILL a process and its session."""
    import os

    p = proc.proc if isinstance(proc, AgentProcess) else proc
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


# -- link resets and half-open links ---------------------------------------------------------------------

def link_fault(a: Store, b: Store, direction: str, fault: str, at: float = 0.5) -> Outcome:
    """Push A's ``cap`` to B's agent (or pull it from A's into B) through the proxy, which resets every
    connection (``fault='reset'``) or goes half-open (``'half-open'``) after ``at`` of the layer went
    through. The clients give up fast; the transfer must fail, leave both stores sound and nothing
    installed; a rerun through the passing proxy must complete sending at most what was missing."""
    served = a if direction == "pull" else b   # the agent behind the proxy
    receiver = b
    lid = top_layer(a)
    raw = object_manifest(a, "layer", lid).nonzero_blocks * BLOCK_SIZE
    out = Outcome(f"{fault} mid-{direction}")
    ag = agent(served.home)
    try:
        with FaultProxy("127.0.0.1", ag.port) as proxy:
            token = ag.token

            def run() -> transfer.TransferReport:
                if direction == "push":
                    return transfer.push(a, "cap", proxy.url, token, fingerprint=ag.fingerprint)
                return transfer.pull(b, proxy.url, "cap", token, fingerprint=ag.fingerprint)

            if fault == "reset":
                proxy.reset_after = int(raw * at)
            else:
                def watch() -> None:
                    while proxy.total < raw * at:
                        time.sleep(0.01)
                    proxy.half_open()
                threading.Thread(target=watch, daemon=True).start()
            t0 = time.monotonic()
            failed = None
            with short_client(timeout=3.0):
                try:
                    run()
                except Exception as exc:  # the error the user would see
                    failed = exc
            took = time.monotonic() - t0
            out.injected = 1
            assert failed is not None, "the transfer went through the fault"
            assert "reach" in str(failed) or "agent" in str(failed), failed
            assert took < 30, f"gave up after {took:.0f} s"
            assert not has_object(receiver, "layer", lid), "installed although the transfer failed"
            assert sound(a) == [] and sound(b) == []
            proxy.pass_through()
            before = arrived(receiver, a, lid)
            report = run()
            assert report.recorded
            sent = sum(o.fetched_bytes for o in report.objects if o.id == lid)
            assert sent <= raw - before, (sent, raw, before)
            assert has_object(receiver, "layer", lid) and sound(a) == [] and sound(b) == []
            out.survived, out.resent, out.missing = 1, sent, raw - before
            out.detail = f"{type(failed).__name__}: {failed}"
    finally:
        ag.stop()
    return out


def reset_retried(a: Store, b: Store, at: float = 0.5, down_for: float = 1.5) -> Outcome:
    """A push through the proxy, which resets every connection once ``at`` of the layer went through and
    refuses (RST) new ones for ``down_for`` s: the push retries its idempotent calls by itself and
    completes, sending again at most the batches that were in flight."""
    lid = top_layer(a)
    raw = object_manifest(a, "layer", lid).nonzero_blocks * BLOCK_SIZE
    out = Outcome("reset mid-push, retried")
    ag = agent(b.home)
    try:
        with FaultProxy("127.0.0.1", ag.port) as proxy:
            proxy.reset_after = int(raw * at)
            proxy.on_reset = lambda: threading.Timer(down_for, proxy.pass_through).start()
            report = transfer.push(a, "cap", proxy.url, ag.token, fingerprint=ag.fingerprint)
            out.injected = proxy.resets
            assert proxy.resets == 1 and report.recorded
            sent = sum(o.fetched_bytes for o in report.objects if o.id == lid)
            assert sound(a) == [] and sound(b) == [] and has_object(b, "layer", lid)
            opts = transfer.Options()
            window = opts.inflight * opts.batch * BLOCK_SIZE
            assert sent <= raw + window, (sent, raw)
            out.survived, out.resent, out.missing = 1, sent - (raw - raw // 2), raw - raw // 2
    finally:
        ag.stop()
    return out


# -- `capsule push` as a process -------------------------------------------------------------------------

def push_cli(a: Store, ag: AgentProcess, url: str | None = None) -> subprocess.Popen:
    """`capsule push` of A's ``cap`` to agent ``ag`` (at ``url``: a proxy in front of it), its pin given."""
    assert ag.fingerprint is not None, "the agent speaks plain HTTP"
    return subprocess.Popen([sys.executable, "-m", "capsule.cli.main", "--home", str(a.home), "push", "cap",
                             "--to", url or ag.url, "--token-file", str(ag.token_file),
                             "--fingerprint", ag.fingerprint], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


# -- a disk that fills up mid-receive --------------------------------------------------------------------

@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (needs root), unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def disk_full(a: Store, tmp: Path, small: str = "48m", large: str = "256m", cache: int | None = 1 << 20
              ) -> Outcome:
    """Push A's ``cap`` (its newest layer larger than the space) to an agent whose store is on a tmpfs of
    ``small``: `capsule push` exits 8 (StorageFull) with nothing half-installed and the store verifying
    clean; the tmpfs grown to ``large``, the rerun completes sending no more of the layer than was
    missing. ``cache``: the receiver's hash cache size (CAPSULE_HASHCACHE_SIZE; the default 64 MiB does
    not fit: the push then fails creating it, before any block)."""
    lid = top_layer(a)
    raw = object_manifest(a, "layer", lid).nonzero_blocks * BLOCK_SIZE
    out = Outcome("disk full mid-receive" if cache else "disk full (hash cache)")
    with tmpfs(tmp / "small", small) as mnt:
        home = mnt / "b"
        ag = agent(home, None, **({"CAPSULE_HASHCACHE_SIZE": str(cache)} if cache else {}))
        b = Store.open(home)
        try:
            proc = push_cli(a, ag)
            _, err = proc.communicate(timeout=300)
            out.injected = 1
            assert proc.returncode == 8, (proc.returncode, err.decode()[-2000:])
            assert not has_object(b, "layer", lid) and b.catalogue.versions() == []
            assert sound(b) == [], sound(b)
            subprocess.run(["mount", "-o", f"remount,size={large}", str(mnt)], check=True)
            before = arrived(b, a, lid)
            report = transfer.push(a, "cap", ag.url, ag.token, fingerprint=ag.fingerprint)
            assert report.recorded and has_object(b, "layer", lid) and sound(b) == []
            sent = sum(o.fetched_bytes for o in report.objects if o.id == lid)
            assert sent <= raw - before, (sent, raw, before)
            out.survived, out.resent, out.missing = 1, sent, raw - before
            out.detail = " ".join(err.decode().split())
        finally:
            ag.stop()
            b.close()
    return out
