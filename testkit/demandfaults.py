"""Faults in the middle of demand paging, on a real guest (issue 14), for tests/vm/test_demand_faults.py and
``bench.faults``: the disk server SIGKILLed at random points of the guest's reads, and the link to the source
reset or gone half-open. Store A holds a capsule whose disk has ``regions`` regions of random blocks no other
store has; B runs it by demand paging through a fault proxy (testkit/faultproxy.py) in front of A's agent (TLS,
pinned). Each
fault strikes while the guest reads a region it never read before; the read must then return the bytes A
reads there, with no I/O error reaching the guest, and B's store must verify clean."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import libvirt

from capsule import capsules, images, lifecycle, transfer
from capsule.console.serial import ConsoleSession
from capsule.lifecycle import demand
from capsule.runtime.connection import lookup_domain
from capsule.store import Store
from capsule.verify import verify
from diskserver import DiskServer
from testkit.faultkit import Outcome, agent
from testkit.faultproxy import FaultProxy

FIRST = 4096        # the first block of the regions: 16 MiB into the tiny image's disk
REGION = 768        # blocks in a region: 3 MiB, 48 direct reads of 64 KiB


def guest_run(store: Store, command: str, timeout: float = 60.0) -> str:
    with ConsoleSession(store.domain_name("cap")) as c:
        return c.run(command, timeout=timeout)


def digest_cmd(skip: int, count: int) -> str:
    """Read with O_DIRECT, one NBD request per 64 KiB: no page cache hides a read from the disk server."""
    return f"dd if=/dev/vda bs=65536 iflag=direct skip={skip // 16} count={count // 16} 2>/dev/null | sha256sum"


class Reader(threading.Thread):
    """The guest reading one region, in the background."""

    def __init__(self, store: Store, skip: int, count: int) -> None:
        super().__init__(daemon=True)
        self.store, self.cmd, self.out, self.error = store, digest_cmd(skip, count), "", ""

    def run(self) -> None:
        try:
            self.out = guest_run(self.store, self.cmd, timeout=300).split()[0]
        except Exception as exc:  # reported by the caller
            self.error = f"{type(exc).__name__}: {exc}"

    def result(self, timeout: float = 300.0) -> str:
        self.join(timeout)
        return "the guest's read did not finish" if self.is_alive() else self.error


def wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class DemandRun:
    a: Store
    b: Store
    proxy: FaultProxy
    regions: list[tuple[int, int, str]]   # (first block, blocks, sha256 as A reads them)
    used: int = 0

    def take(self) -> tuple[int, int, str]:
        """A region no test has read yet."""
        self.used += 1
        return self.regions[self.used - 1]

    @property
    def inst_dir(self) -> Path:
        inst = self.b.catalogue.instance("cap")
        assert inst is not None
        return Path(inst.dir)

    def server(self) -> DiskServer:
        return demand.server_for(self.inst_dir, 0)

    def running(self) -> bool:
        dom = lookup_domain(self.b.domain_name("cap"))
        return dom is not None and dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING

    def guest_io_errors(self) -> int:
        return int(guest_run(self.b, "dmesg | grep -ci 'i/o error' || true"))

    def revivals(self) -> int:
        return (self.inst_dir / "watch.log").read_text().count("started again")


@contextmanager
def demand_run(tmp: Path, source: Store, regions: int) -> Iterator[DemandRun]:
    a, b = Store.open(tmp / "a"), Store.open(tmp / "b")
    for s, names in ((a, ["tiny"]), (b, [])):
        for name in names:
            images.import_image(source, s, name)
    ag = agent(a.home)
    try:
        capsules.create(a, "cap", "tiny", memory="256M")
        lifecycle.start(a, "cap")
        guest_run(a, f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={FIRST} count={regions * REGION} "
                     f"conv=notrunc 2>/dev/null; sync")
        spans = [(FIRST + i * REGION, REGION) for i in range(regions)]
        digests = [guest_run(a, digest_cmd(s, n)).split()[0] for s, n in spans]
        lifecycle.stop(a, "cap", force=True)
        with FaultProxy("127.0.0.1", ag.port) as proxy:
            transfer.run(b, proxy.url, "cap", ag.token, fingerprint=ag.fingerprint)
            try:
                yield DemandRun(a, b, proxy, [(s, n, d) for (s, n), d in zip(spans, digests, strict=True)])
            finally:
                lifecycle.stop(b, "cap", force=True, discard=True)
    finally:
        ag.stop()
        a.close()
        b.close()


def _settle(run: DemandRun, out: Outcome, reader: Reader, digest: str, what: str) -> None:
    """Count the fault survived when the read finished with A's bytes and the guest runs unharmed."""
    error = reader.result()
    if not error and reader.out != digest:
        error = "the guest read other bytes than the source holds"
    if not error and not run.running():
        error = "the guest is not running"
    if error:
        out.detail = out.detail or f"{what}: {error}"
    else:
        out.survived += 1


def server_kills(run: DemandRun, times: int, seed: int = 14, max_delay: float = 1.5) -> Outcome:
    """``times`` times: the guest reads a fresh region and the disk server is SIGKILLed a random moment
    into it (before, during or after its reads); the instance's watcher must start it again. Bytes: what
    crossed the proxy from A over the bytes of the regions read."""
    rnd = random.Random(seed)
    out = Outcome("SIGKILL disk server mid-demand-paging")
    before = run.proxy.down
    for i in range(times):
        skip, count, digest = run.take()
        reader = Reader(run.b, skip, count)
        reader.start()
        time.sleep(rnd.uniform(0.0, max_delay))
        server = run.server()
        if not server.alive():
            out.detail = out.detail or f"kill {i}: no disk server was running"
            reader.result()
            continue
        server.kill()
        out.injected += 1
        try:
            wait(lambda: run.server().alive(), 60, "the watcher to start the disk server again")
        except TimeoutError as exc:
            out.detail = out.detail or f"kill {i}: {exc}"
        _settle(run, out, reader, digest, f"kill {i}")
        out.missing += count * 4096
    out.resent = run.proxy.down - before
    _check_unharmed(run, out)
    return out


def link_fault(run: DemandRun, fault: str, hold: float = 3.0) -> Outcome:
    """The link to A reset (every connection, and new ones, for ``hold`` s) or half-open, once the guest's
    reads of a fresh region are under way; the read must wait and then complete."""
    out = Outcome(f"{fault} mid-demand-paging")
    skip, count, digest = run.take()
    before = run.proxy.down
    reader = Reader(run.b, skip, count)
    reader.start()
    wait(lambda: run.proxy.down > before + (256 << 10), 60, "the guest's reads to reach the source")
    run.proxy.reset() if fault == "reset" else run.proxy.half_open()
    out.injected = 1
    time.sleep(hold)
    if not reader.is_alive():
        out.detail = f"the read ended while the link was down: {reader.error or 'it should have waited'}"
    run.proxy.pass_through()
    _settle(run, out, reader, digest, fault)
    out.resent, out.missing = run.proxy.down - before, count * 4096
    _check_unharmed(run, out)
    return out


def _check_unharmed(run: DemandRun, out: Outcome) -> None:
    """No I/O error reached the guest and B's store verifies clean (its remote layers are not installed, by
    design: they are the demand-paged ones); otherwise nothing counts as survived."""
    problems = [f"{p.kind} {p.id[:12]}: {p.error}" for p in verify(run.b).problems]
    if errors := run.guest_io_errors():
        problems.append(f"{errors} I/O error(s) in the guest's kernel log")
    if problems:
        out.detail = out.detail or problems[0]
        out.survived = 0
