"""Deciding between KVM and TCG by a real probe boot.

/dev/kvm may exist and KVM_CREATE_VM may succeed while KVM guests never run
(the vCPU spins). The only trustworthy test is to boot a tiny guest under KVM
and see it print its marker. The result is cached per host boot."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import libvirt

from capsule.console.serial import wait_for_marker
from capsule.errors import CapsuleError
from capsule.runtime import guestaccess
from capsule.runtime.connection import connect, lookup_domain
from capsule.runtime.domainxml import MachineSpec, build
from hashcache.atomic import write_atomic

PROBE_TIMEOUT = 20.0


@dataclass
class AccelDecision:
    accel: str      # "kvm" or "tcg"
    reason: str
    boot_id: str
    probed_at: float


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def probe_kvm(kernel: Path, initrd: Path, cmdline: str, marker: str,
              timeout: float = PROBE_TIMEOUT) -> tuple[bool, str]:
    """Boot the tiny guest under KVM; True only if it prints its marker in time."""
    if not os.path.exists("/dev/kvm"):
        return False, "/dev/kvm does not exist"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible"
    name = f"capsule-kvm-probe-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="capsule-probe-") as tmp:
        log = Path(tmp) / "console.log"
        log.touch(mode=0o600)   # ours: virtlogd (root) appends to it, an agent that is not root still reads it
        spec = MachineSpec(name=name, uuid=str(uuid.uuid4()), memory_mib=128, vcpus=1, accel="kvm",
                           kernel=kernel, initrd=initrd, cmdline=cmdline, disks=[], console_log=log,
                           agent_socket=Path(tmp) / "agent.sock")
        start = time.monotonic()
        try:
            # the probe's kernel and initrd are the tiny image's, in a store (``files/``)
            guestaccess.grant_machine(kernel.parent.parent, kernel=kernel, initrd=initrd, leaves=[],
                                      instance_dir=Path(tmp))
            dom = connect().createXML(build(spec), 0)
        except CapsuleError as exc:
            return False, f"a KVM probe guest cannot start: {exc}"
        except libvirt.libvirtError as exc:
            return False, f"libvirt cannot start a KVM guest: {exc.get_error_message()}"
        try:
            wait_for_marker(log, marker, timeout, domain=name)
            return True, f"a KVM probe guest booted in {time.monotonic() - start:.1f}s"
        except CapsuleError:
            return False, f"a KVM probe guest did not boot within {timeout:.0f}s (KVM present but not working)"
        finally:
            if lookup_domain(name) is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    dom.destroy()


def default_cache() -> Path:
    """The probe's verdict is per host (and per host boot), not per store."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "capsule" / "accel.json"


def decide(cache: Path, probe_image: tuple[Path, Path, str, str] | None, refresh: bool = False) -> AccelDecision:
    """KVM or TCG for this host. ``CAPSULE_ACCEL=tcg|kvm`` forces a choice."""
    forced = os.environ.get("CAPSULE_ACCEL")
    if forced in ("tcg", "kvm"):
        return AccelDecision(forced, "forced by CAPSULE_ACCEL", _boot_id(), time.time())
    boot = _boot_id()
    if cache.exists() and not refresh:
        try:
            cached = AccelDecision(**json.loads(cache.read_text()))
            if cached.boot_id == boot:
                return cached
        except (ValueError, TypeError):
            pass
    if probe_image is None:
        decision = AccelDecision("tcg", "no probe image yet (capsule image build tiny) - using TCG", boot, time.time())
        return decision  # not cached: probe once the image exists
    missing = [str(f) for f in probe_image[:2] if not Path(f).is_file()]
    if missing:         # a store that records the image without its files: not cached either
        return AccelDecision("tcg", f"the KVM probe's kernel or initrd is missing ({', '.join(missing)}) - using "
                             "TCG", boot, time.time())
    ok, why = probe_kvm(*probe_image)
    decision = AccelDecision("kvm" if ok else "tcg", why, boot, time.time())
    write_atomic(cache, json.dumps(asdict(decision)).encode(), durable=False)
    return decision
