"""Two running Debian capsules with the pod layer, booted once and shared by the pod tests (the fixtures
``pod_pair`` and ``pod_network_pair`` in tests/vm/conftest.py): a pair's boot is most of a pod test's time
under TCG, and its pods are what a test is about. Each test makes pods of its own in the pair; after it
(passed or failed) every pod in the pair is killed, a capsule it left suspended is started again, and a
capsule left with a disk it did not boot with fails the test and sends the pair away, so the next test
starts from a clean pair (a pair sent away is booted again by the next test that asks for it)."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from capsule import capsules, lifecycle
from capsule.errors import Error
from capsule.pod import ops
from capsule.pod.relay import Relay
from capsule.runtime.connection import lookup_domain
from capsule.store import Store
from testkit.images import destroy_domains, make_store

# the pod layer's compiled modules in the guest
PYCACHE = "/usr/lib/python3/dist-packages/pods/__pycache__"


class PairNotClean(AssertionError):
    """A test left the pair in a state the next test must not inherit."""


@dataclass
class PodPair:
    """Capsules ``a`` and ``b`` (512M of Debian each), on the host's pod network or not (a capsule's pod network
    is fixed when it is made). ``compiled``: each one's PYCACHE listing, taken at its boot before any pod call."""

    a: str
    b: str
    pod_network: bool
    fixtures: tuple[str, ...]   # the fixtures that hand it out (tests/vm/conftest.py)
    store: Store | None = None
    compiled: dict[str, list[str]] = field(default_factory=dict)
    disks: dict[str, int] = field(default_factory=dict)
    boot_seconds: float = 0.0

    @property
    def names(self) -> tuple[str, str]:
        return self.a, self.b

    def up(self, base: Path, images: Store) -> Store:
        """The pair's store, both capsules running (booted here on first use, in a new store under ``base``)."""
        if self.store is None:
            started = time.monotonic()
            self.store = make_store(base / "store", images, "debian")
            try:
                for name in self.names:
                    capsules.create(self.store, name, "debian", memory="512M", pod_network=self.pod_network)
                with ThreadPoolExecutor(2) as pool:   # both boot at once (a TCG guest boots on one core)
                    for done in [pool.submit(self._boot, name) for name in self.names]:
                        done.result()
            except BaseException:
                self.close()
                raise
            self.boot_seconds = time.monotonic() - started
            print(f"pod pair {self.a}, {self.b}{' (pod network)' if self.pod_network else ''}: "
                  f"booted in {self.boot_seconds:.1f} s")
        return self.store

    def _boot(self, name: str) -> None:
        assert self.store is not None
        lifecycle.start(self.store, name, timeout=400)
        self.compiled[name] = Relay(self.store, name).sh(f"ls {PYCACHE}").split()
        self.disks[name] = self._disks(name)

    def _disks(self, name: str) -> int:
        assert self.store is not None
        inst = self.store.catalogue.instance(name)
        domain = lookup_domain(inst.domain) if inst else None
        assert domain is not None, f"capsule {name!r} has no running domain"
        return domain.XMLDesc(0).count("<disk ")

    def clean(self) -> None:
        """Kill every pod of the pair and start a capsule left suspended; a pair that cannot be made clean
        is sent away (closed) and PairNotClean raised."""
        if self.store is None:
            return
        store = self.store
        try:
            for name in self.names:
                if store.catalogue.instance(name) is None:
                    lifecycle.start(store, name, timeout=400)
                if pods := ops.ls(store, name):   # (each listing is a call into the guest: one if it has none)
                    for pod in pods:
                        with contextlib.suppress(Error):
                            ops.kill(store, f"{name}/{pod['name']}")
                    if left := ops.ls(store, name):
                        raise PairNotClean(f"capsule {name!r} still has pods after the test: {left}")
                if (n := self._disks(name)) != self.disks[name]:
                    raise PairNotClean(f"capsule {name!r} has {n} disks after the test, "
                                       f"{self.disks[name]} at its boot")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.store is not None:
            destroy_domains(self.store)
            self.store.close()
        self.store = None
        self.compiled.clear()
        self.disks.clear()


# the two pairs of a session: what the fixtures of the same names hand out
PAIRS = {"pa": PodPair("pa", "pb", pod_network=False, fixtures=("pod_pair", "module_pod_pair")),
         "na": PodPair("na", "nb", pod_network=True, fixtures=("pod_network_pair",))}


def release_unneeded(items: list, done: int) -> None:
    """Close every pair no test after ``items[done]`` asks for (its guests would only hold memory and CPU)."""
    for pair in PAIRS.values():
        if pair.store is not None and not any(f in it.fixturenames for it in items[done + 1:] for f in pair.fixtures):
            pair.close()
