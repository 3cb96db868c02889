"""``capsule doctor``: what is installed, whether libvirt answers, and whether
guests will run under KVM or TCG (with the reason)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from capsule import sandbox
from capsule.errors import CapsuleError
from capsule.runtime.connection import connect, libvirt_uri
from capsule.runtime.guestaccess import USER_ENV, check_reachable, guest_user
from capsule.store import Store
from capsule.store.locks import describe_holder
from capsule.store.modes import check_modes


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    accel: str = "tcg"
    accel_reason: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "accel": self.accel, "accel_reason": self.accel_reason,
                "checks": [asdict(c) for c in self.checks]}


def _version_of(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else ""


def _at_least(text: str | None, minimum: tuple[int, ...]) -> bool:
    if not text:
        return False
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return False
    found = tuple(int(x or 0) for x in m.groups())
    return found >= minimum


def _modes_check(store: Store) -> Check:
    problems = check_modes(store)
    if not problems:
        return Check("store modes", True, "directories 0700 (0710 where guests open files), memory images 0400, "
                                          "other objects 0440")
    shown = "; ".join(f"{p.path} is {p.mode:04o} (want {p.expected:04o})" for p in problems[:3])
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return Check("store modes", False, f"{shown}{more} — run `capsule verify --fix-modes` to repair")


def _guest_user_check(store: Store | None) -> Check:
    """Who QEMU runs as, and whether it can reach this store (``runtime.guestaccess``)."""
    try:
        user = guest_user()
        if user.unconfined:
            return Check("guest user", True, "QEMU runs as root: no confinement (no libvirt-qemu user, or "
                                             f"{USER_ENV}=root)")
        if store is not None:
            check_reachable(store.home, user)
    except CapsuleError as exc:
        return Check("guest user", False, str(exc))
    return Check("guest user", True, f"QEMU runs as {user.name} (uid {user.uid}); libvirt relabels nothing, "
                                     "the store grants its group what each guest opens")


def _sandbox_check() -> Check:
    """The unprivileged user guest file systems are parsed as (``capsule.sandbox``)."""
    try:
        uid, _ = sandbox.ids()
    except CapsuleError as exc:
        return Check("sandbox user", False, str(exc))
    return Check("sandbox user", True, f"guest file systems are parsed as {sandbox.USER} (uid {uid}), "
                                       "with no capabilities")


def doctor(store: Store | None, probe: bool = True, reprobe: bool = False) -> DoctorReport:
    report = DoctorReport()
    tools = [
        ("qemu-system-x86_64", ["qemu-system-x86_64", "--version"], (10, 0)),
        ("qemu-img", ["qemu-img", "--version"], (10, 0)),
        ("nbdkit", ["nbdkit", "--version"], (1, 30)),
        ("mmdebstrap", ["mmdebstrap", "--version"], (1, 0)),
        ("zstd", ["zstd", "--version"], (1, 4)),
        ("mkfs.ext4", ["mkfs.ext4", "-V"], (1, 46)),
    ]
    for name, cmd, minimum in tools:
        v = _version_of(cmd)
        if v is None:
            report.checks.append(Check(name, False, "not installed (run `make setup`)"))
        else:
            ok = _at_least(v, minimum)
            need = ".".join(map(str, minimum))
            report.checks.append(Check(name, ok, v if ok else f"{v} — need ≥ {need}"))
    try:
        conn = connect()
        lib = conn.getLibVersion()
        hv = conn.getVersion()
        libv = f"{lib // 1000000}.{lib // 1000 % 1000}.{lib % 1000}"
        ok = lib >= 11003000
        report.checks.append(Check("libvirt", ok, f"libvirt {libv} at {libvirt_uri()}, QEMU "
                                   f"{hv // 1000000}.{hv // 1000 % 1000}.{hv % 1000}"
                                   + ("" if ok else " — need libvirt ≥ 11.3")))
    except CapsuleError as exc:
        report.checks.append(Check("libvirt", False, str(exc)))
    report.checks.append(_guest_user_check(store))
    report.checks.append(_sandbox_check())
    if store is not None:
        report.checks.append(Check("store", True, f"{store.home} (id {store.id})"))
        report.checks.append(_modes_check(store))
        holder = store.lock_holder()
        report.checks.append(Check("store lock", True, "free" if holder is None
                                   else f"held by {describe_holder(holder)}"))
        if probe and all(c.ok for c in report.checks if c.name == "libvirt"):
            from capsule.lifecycle import accel_for

            decision = accel_for(store, refresh=reprobe)
            report.accel, report.accel_reason = decision.accel, decision.reason
    return report
