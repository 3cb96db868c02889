"""``update make``: a new version with software installed or updated inside a real boot of the base.

The base ``NAME[@V]`` is booted (as a child capsule ``--name NEW``, or as its own next version when NEW is
the base's capsule) with a NIC on QEMU's user-mode network; the steps run inside through the guest agent
with their output live (``update.guest``); apt's downloads and list files live in tmpfs for the run and are
dropped, then ``apt-get clean``; every file system is trimmed; the guest shuts down cleanly and its leaf,
rid of the zero marks the parent already reads as zero (``capsule.lifecycle.compact``) and of the ext4 journal's dead
blocks (``update.journal``), is sealed as the new version.
A step that fails, a timeout or an interrupt leaves nothing behind: the leaf is dropped (and a child
capsule made for the run removed)."""

from __future__ import annotations

import contextlib
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsule import capsules, lifecycle
from capsule.errors import AlreadyExists, CapsuleError, Conflict, Error, GuestTimeout, InvalidName
from capsule.names import check_name, parse_ref
from capsule.runtime.guestagent import AgentError, wait_for_agent
from capsule.store import Store, claims
from capsule.store.catalogue import VersionRow
from capsule.update import journal
from capsule.update.guest import GuestShell, Output, StepResult, need_to_get

NETWORK = "192.0.2.0/24"     # the guest side of QEMU's user network (TEST-NET-1: never routed anywhere)
STEP_TIMEOUT = 3600.0
# systemd's journal stays in the guest's RAM (/run/log/journal) for the whole run: without the flush
# request at boot journald never opens /var/log/journal, so no journal file lands in the new layer
KERNEL_ARGS = "systemd.mask=systemd-journal-flush.service"
APT = "apt-get -y -q -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.\-]*(:[a-z0-9]+)?(=[\w.+~:-]+|/[\w.+~-]+)?")

Say = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


@dataclass
class Step:
    label: str
    script: str


def plan_steps(run: list[str], install: list[str], upgrade: bool) -> list[Step]:
    """The steps in order: apt's (update, upgrade, install) first, then each ``--run`` command."""
    bad = [p for p in install if not _PACKAGE.fullmatch(p)]
    if bad:
        raise InvalidName(f"not Debian package names: {', '.join(bad)} (e.g. jq, nginx=1.22.1-9, tree/bookworm)")
    if not (run or install or upgrade):
        raise InvalidName("nothing to do: give --run 'CMD', --install PKG or --upgrade")
    steps: list[Step] = []
    if install or upgrade:
        steps.append(Step("apt-get update", f"{APT} update"))
    if upgrade:
        steps.append(Step("apt-get upgrade", f"{APT} upgrade"))
    if install:
        steps.append(Step(f"apt-get install {' '.join(install)}", f"{APT} install {shlex.join(install)}"))
    steps += [Step(cmd, cmd) for cmd in run]
    return steps


@dataclass
class UpdateResult:
    base: VersionRow
    version: VersionRow | None        # None: the guest changed nothing on its disks
    steps: list[StepResult]
    apt_debs_bytes: int               # .debs apt downloaded (measured in its tmpfs before it was dropped)
    apt_lists_bytes: int              # apt's list files (same)
    apt_need_to_get: int              # what apt said it would download ("Need to get …", rounded)
    trimmed_bytes: int                # what fstrim reported
    zero_marks_dropped: int
    journal_blocks_dropped: int       # the ext4 journal's blocks the run wrote, dropped (capsule.update.journal)
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base.ref, "version": self.version.ref if self.version else None,
                "steps": [{"command": s.label, "exit_code": s.exit_code, "seconds": round(s.seconds, 2),
                           "output_bytes": s.output_bytes} for s in self.steps],
                "apt_fetched_bytes": self.apt_debs_bytes, "apt_lists_bytes": self.apt_lists_bytes,
                "apt_need_to_get_bytes": self.apt_need_to_get, "trimmed_bytes": self.trimmed_bytes,
                "zero_marks_dropped": self.zero_marks_dropped,
                "journal_blocks_dropped": self.journal_blocks_dropped, "layers": self.layers,
                "seconds": round(self.seconds, 2)}


class StepFailed(CapsuleError):
    """A command of the update failed inside the guest; nothing was recorded."""

    code = "update_step_failed"
    exit_code = 17
    http_status = 422


def _layer_info(store: Store, layer_id: str) -> dict[str, Any]:
    row = store.catalogue.layer(layer_id)
    path = store.layer_path(layer_id)
    manifest = store.layer_manifest(layer_id)
    assert row is not None
    return {"id": layer_id, "file_bytes": path.stat().st_size, "allocated_bytes": row.file_size,
            "data_bytes": manifest.stored_bytes, "data_blocks": manifest.nonzero_blocks,
            "zero_blocks": manifest.zero_blocks}


def _prepare(store: Store, base_ref: str, name: str | None) -> tuple[VersionRow, str, bool]:
    """(base version, the capsule to run, whether it was made for this update)."""
    base = capsules.resolve(store, base_ref)
    target = name or base.capsule
    check_name(target)
    if target == base.capsule:
        if store.catalogue.instance(target) is not None:
            raise Conflict(f"capsule {target!r} is running; stop it first (the update boots {base.ref} itself)")
        latest = store.catalogue.latest_version(target)
        if parse_ref(base_ref).version is not None and latest and latest.number != base.number:
            raise Conflict(f"{base.ref} is not {target}'s latest version ({latest.ref}): a new version of "
                           f"{target} builds on its latest; give --name NEW to make a child of {base.ref}")
        return base, target, False
    if store.catalogue.capsule(target) is not None:
        raise AlreadyExists(f"a capsule named {target!r} already exists; to add a version to it, give it as "
                            f"the base (`capsule update make {target} …`), or choose another --name")
    capsules.derive(store, base.ref, target, memory=False, note=f"derived from {base.ref} for an update")
    return base, target, True


def make(store: Store, base_ref: str, *, name: str | None = None, run: list[str] | None = None,
         install: list[str] | None = None, upgrade: bool = False, network: bool = True,
         timeout: float = STEP_TIMEOUT, say: Say = _quiet, output: Output = _quiet) -> UpdateResult:
    """Boot ``base_ref``, run the steps inside, seal the result as a new version (see the module's doc).
    ``say`` gets progress lines, ``output`` the commands' output as it comes."""
    steps = plan_steps(list(run or []), list(install or []), upgrade)
    t0 = time.monotonic()
    base, target, made = _prepare(store, base_ref, name)
    if base.memory:
        say(f"{base.ref} is a suspended version: booted from its disks as they were saved (as after a power "
            "cut: what only its memory held is not there); make updates from stopped versions")
    with claims.claim(store, target, "being updated"):   # booted, changed and stopped: nothing else meanwhile
        net = NETWORK if network else None
        try:
            lifecycle.start(store, target, boot=True, network=net, timeout=300, kernel_args=KERNEL_ARGS, say=say)
            inst = store.catalogue.instance(target)
            assert inst is not None
            say("waiting for the guest agent")
            wait_for_agent(Path(inst.dir) / "agent.sock", timeout=120)
            shell = GuestShell(Path(inst.dir) / "agent.sock")
            if net:
                say("network: QEMU user-mode NAT")
                shell.network_up(net)
            mounted = shell.scratch_up()
            if mounted:
                say(f"apt's scratch space in RAM: {', '.join(mounted)}")
            results: list[StepResult] = []
            text: list[str] = []

            def out(chunk: str) -> None:
                text.append(chunk)
                output(chunk)

            for step in steps:
                say(f"running: {step.label}")
                res = shell.run(step.label, step.script, out, timeout)
                results.append(res)
                if res.exit_code != 0:
                    raise StepFailed(f"`{step.label}` failed in the guest (exit {res.exit_code}); nothing was "
                                     f"recorded{f' and {target} was removed' if made else ''}")
            debs, lists = shell.scratch_down(mounted, net is not None)
            shell.forget_machine_id()
            say("discarding freed blocks (fstrim)")
            trimmed = shell.trim()
            jmap = _journal_map(shell)
            say("shutting the guest down")
            sealed = lifecycle.stop(store, target, timeout=120, compact=True, note=_note(steps), say=say,
                                    release=journal.releaser(jmap, store.layer_path, say))
        except BaseException:
            # whatever stopped it (a failed step, a boot that timed out, Ctrl-C while the boot was awaited):
            # an instance the start recorded is stopped and dropped before its capsule may be removed
            if store.catalogue.instance(target) is not None:
                with contextlib.suppress(Error):
                    lifecycle.stop(store, target, force=True, discard=True)
            if made:
                with contextlib.suppress(Error):
                    _remove_capsule(store, target)
            raise
        version = sealed.version
        layers = [_layer_info(store, row.id) for row in sealed.layers]
        return UpdateResult(base, version, results, debs, lists, need_to_get("".join(text)), trimmed,
                            sealed.zero_marks_dropped, sealed.released_blocks, layers, time.monotonic() - t0)


def _journal_map(shell: GuestShell) -> journal.JournalMap | None:
    """Where the root file system's ext4 journal is (read in the guest; None: not one we can drop)."""
    try:
        return journal.parse_guest(shell.sh(journal.GUEST_SCRIPT, timeout=60))
    except (AgentError, GuestTimeout):
        return None


def _note(steps: list[Step]) -> str:
    text = "; ".join(s.label for s in steps)
    return "update: " + (text if len(text) <= 200 else text[:197] + "...")


def _remove_capsule(store: Store, name: str) -> None:
    """The child made for a failed update: its versions and the capsule (its layers are the base's)."""
    with store.lock():
        cat = store.catalogue
        with cat.transaction():
            for v in cat.versions(name):
                cat.delete_version(name, v.number)
            cat.delete_capsule(name)
