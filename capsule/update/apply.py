"""``update apply``: a user's capsule moves to a new system version and keeps its data.

The rule. A capsule's disk 0 (vda) is its *system disk*: it comes from a system version (an image, or a
fleet capsule's version such as ``web@3``) and belongs to whoever makes those. Its other disks (vdb, …,
``capsule create --data-disk``) are *data disks* and belong to the capsule's user. ``apply NAME --system
SYS@V`` records a new version of NAME whose system disk is exactly SYS@V's (its layer chain, with SYS@V's
kernel, initrd and command line) and whose data disks, memory size and CPUs are NAME's own, unchanged.
What NAME's guest itself wrote on its system disk since its system was applied is not carried over (it
stays in NAME's earlier versions).

It is refused, changing nothing, when SYS@V is not derived from NAME's current system: SYS@V's system
chain must start with every layer of the system NAME runs on now, and add at least one. A different base,
an older version (a downgrade) or the same one again is refused by name. NAME must be stopped; ``restart``
stops it cleanly first (a suspended one is resumed, then stopped cleanly: its data disks are consistent
only with its memory) and boots the new version afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsule import capsules, lifecycle
from capsule.errors import Conflict, InvalidName
from capsule.names import parse_ref
from capsule.store import Store, claims
from capsule.store.catalogue import VersionRow

SYSTEM_KEYS = ("kernel", "initrd", "cmdline", "marker", "image")   # config that comes with a system disk

Say = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


class NotDerived(Conflict):
    """The system version does not build on the capsule's current system."""

    code = "not_derived"


@dataclass
class ApplyResult:
    before: VersionRow
    version: VersionRow
    system: VersionRow
    dropped_layers: list[str]       # the capsule's own layers on its old system disk, not carried over
    restarted: bool
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"capsule": self.version.capsule, "before": self.before.ref, "version": self.version.ref,
                "system": self.system.ref, "system_chain": self.version.chains[0],
                "data_disks": [c[-1] for c in self.version.chains[1:]],
                "dropped_system_layers": self.dropped_layers, "restarted": self.restarted,
                "seconds": round(self.seconds, 2)}


def current_system(store: Store, version: VersionRow) -> tuple[list[str], str]:
    """(the system chain ``version`` runs on, what it is called): the one ``apply`` recorded; else the
    version the capsule was derived from, or its image's root layer, whichever its disk 0 starts with;
    else its earliest version's disk 0."""
    recorded = version.config.get("system")
    if isinstance(recorded, dict) and isinstance(recorded.get("chain"), list):
        return list(recorded["chain"]), str(recorded.get("ref", "the recorded system"))
    own = version.chains[0]
    cap = store.catalogue.capsule(version.capsule)
    if cap is not None and cap.parent_capsule and cap.parent_version:
        parent = store.catalogue.version(cap.parent_capsule, cap.parent_version)
        if parent is not None and own[:len(parent.chains[0])] == parent.chains[0]:
            return list(parent.chains[0]), parent.ref
    if cap is not None and cap.image:
        img = store.catalogue.image(cap.image)
        if img is not None and own[:1] == [img.root_layer]:
            return [img.root_layer], f"image {img.name}"
    first = store.catalogue.versions(version.capsule)[0]
    return list(first.chains[0]), first.ref


def check_derived(name: str, current: list[str], label: str, system: VersionRow) -> None:
    new = system.chains[0]
    if new == current:
        raise NotDerived(f"{name} already runs on that system ({system.ref} has the same system disk as "
                         f"{label}); nothing to apply")
    if new[:len(current)] != current:
        common = next((i for i, (a, b) in enumerate(zip(new, current, strict=False)) if a != b),
                      min(len(new), len(current)))
        why = ("it is older: its system disk lacks layers " + ", ".join(x[:12] for x in current[len(new):])
               if common == len(new) else f"its layer {common + 1} is {new[common][:12]} where {label} has "
                                          f"{current[common][:12]}")
        raise NotDerived(f"{system.ref} is not derived from {name}'s current system ({label}): {why}. "
                         f"apply only moves a capsule forward, onto a version made from the system it runs on")


def _settle(store: Store, name: str, restart: bool, stop_timeout: float, say: Say) -> bool:
    """Bring NAME to a clean stop (only with ``restart``); True if it was running or suspended."""
    state = capsules.state_of(store, name)
    if state.state == "stopped":
        return False
    if state.state == "crashed":
        raise Conflict(f"{name} has a stale instance whose domain is gone; `capsule stop {name}` first")
    if not restart:
        hint = "its data disks are consistent only with its memory" if state.state == "suspended" else \
            "its disks are in use"
        raise Conflict(f"{name} is {state.state} ({hint}): stop it first, or give --restart to stop it "
                       f"cleanly, apply, and boot the new version")
    if state.state == "suspended":
        say(f"resuming {state.latest.ref} to stop it cleanly")
        lifecycle.start(store, name, say=say)
    say(f"stopping {name} cleanly")
    lifecycle.stop(store, name, timeout=stop_timeout, say=say)
    return True


def apply(store: Store, name: str, system_ref: str, *, restart: bool = False, stop_timeout: float = 120.0,
          say: Say = _quiet) -> ApplyResult:
    """A new version of ``name`` on ``system_ref``'s system disk, keeping its data disks and config.
    ``stop_timeout``: with ``restart``, how long the guest may take to shut down before it is forced off."""
    t0 = time.monotonic()
    if parse_ref(name).version is not None:
        raise InvalidName(f"give the capsule as NAME, not {name!r}: apply makes its next version")
    with claims.claim(store, name, "being updated"):   # its stop, record and start: nothing else meanwhile
        with store.lock():
            before = capsules.resolve(store, name)
            system = capsules.resolve(store, system_ref)
            if system.capsule == name:
                raise InvalidName(f"{system.ref} is a version of {name} itself: --system takes another capsule's "
                                  "version (e.g. the fleet's)")
            current, label = current_system(store, before)
            check_derived(name, current, label, system)
        ran = _settle(store, name, restart, stop_timeout, say)
        with store.lock():
            cat = store.catalogue
            latest = capsules.resolve(store, name)
            if latest.number != before.number and not ran:
                raise Conflict(f"{name} changed while it was being applied to ({latest.ref}); run it again")
            if cat.instance(name) is not None:
                raise Conflict(f"{name} was started meanwhile; nothing was applied")
            current, label = current_system(store, latest)
            check_derived(name, current, label, system)
            config = {k: v for k, v in latest.config.items() if k not in (*SYSTEM_KEYS, "balloon")}
            config.update({k: system.config[k] for k in SYSTEM_KEYS if k in system.config})
            config["system"] = {"ref": system.ref, "chain": list(system.chains[0])}
            with cat.transaction():
                version = VersionRow(capsule=name, number=cat.next_version_number(name), parent_capsule=name,
                                     parent_version=latest.number, memory=None,
                                     chains=[list(system.chains[0]), *(list(c) for c in latest.chains[1:])],
                                     config=config, note=f"system {system.ref} applied", created=time.time())
                cat.add_version(version)
        dropped = latest.chains[0][len(current):]
        say(f"{version.ref}: system {system.ref}, {len(version.chains) - 1} data disk(s) kept")
        if ran:
            say(f"booting {version.ref}")
            lifecycle.start(store, version.ref, say=say)
        return ApplyResult(latest, version, system, dropped, ran, time.monotonic() - t0)
