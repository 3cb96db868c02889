"""A post-copy whose link broke: resumed when the link returns, or the guest started again here when it does not.

After the switchover to post-copy the guest runs at the other host while its last pages still come from here:
neither side holds its whole memory. When the link breaks then, QEMU pauses the migration on both sides
(``postcopy-paused``) instead of failing it: libvirt reports the domain here paused (post-copy failed) and the
one there running (post-copy failed; its vCPUs wait on each page they fault on that is still here). Nothing is
lost yet.

- :func:`resume` tries every :data:`RETRY` seconds until a try completes or ``timeout`` passes; a try
  (:func:`attempt`) asks the other host's QEMU to listen again (``migrate-recover``) and this host's QEMU to
  reconnect and resume (``migrate`` with ``resume``). Each try opens a new connection through the same tunnel
  entrance: the other host's session admits it while the session lives, and its memory codec decodes a new
  connection as it did the first.
- When the link does not return in time, :class:`PostcopyLost` is raised, and :func:`start_here` brings the
  guest back here from the last consistent state this host holds: its disks as they were at the switchover
  (this host's QEMU stopped writing them then; QEMU refuses to resume or cancel a post-copy at its source, so
  its memory cannot be had back). The guest boots from those disks, as after a power cut at the switchover:
  what it held only in memory is lost, what it wrote to its disks up to the switchover is kept, and what it
  did at the other host after the switchover is lost. The other host removes its half of the guest by itself
  (:mod:`capsule.exchange.stranded`) once its own wait is over, or at once when this host can still ask it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import libvirt

from capsule.errors import RuntimeFailure
from capsule.lifecycle import instances
from capsule.runtime import qmp
from capsule.runtime.connection import postcopy_failed
from capsule.store import Store

RETRY = 3.0                 # seconds between two attempts to resume
POLL = 0.5                  # seconds between two looks at a resumed migration
NOTE = "live move: disks at the switchover (post-copy lost)"


class PostcopyLost(RuntimeFailure):
    """The link broke during post-copy and did not return within the recover timeout."""

    code = "postcopy_lost"


def resume(dom: libvirt.virDomain, attempt: Callable[[], None], *, timeout: float, say: Callable[[str], None],
           watch: Callable[[threading.Thread, list[BaseException]], Any], retry: float = RETRY) -> Any:
    """Resume the failed post-copy of ``dom`` (``attempt``: one try, :func:`attempt` with its arguments bound;
    it raises when the try fails) until a try completes (``watch``'s answer: it follows the job as it did the
    first time) or ``timeout`` seconds pass (:class:`PostcopyLost`); a try still under way then (a link that half
    works) is interrupted (libvirt's abort of a post-copy: QEMU's ``migrate-pause``). A post-copy cannot be
    cancelled: the guest runs at the other host."""
    deadline = time.monotonic() + timeout
    attempts = 0
    last = "the link broke"
    while True:
        if time.monotonic() >= deadline:
            raise PostcopyLost(f"the link to the other host did not return within {timeout:.0f} s of post-copy "
                               f"({attempts} attempts to resume; the last: {last})")
        if not postcopy_failed(dom, incoming=False):
            raise RuntimeFailure("the post-copy cannot be resumed: the guest here is no longer waiting for it "
                                 f"(libvirt: {_state(dom)})")
        attempts += 1
        errors: list[BaseException] = []

        def run(errors: list[BaseException] = errors) -> None:
            try:
                attempt()
            except BaseException as failure:  # noqa: BLE001 - handed to the watching thread
                errors.append(failure)

        worker = threading.Thread(target=run, name="live-migrate-resume", daemon=True)
        worker.start()
        stop = threading.Timer(max(0.0, deadline - time.monotonic()), _interrupt, (dom, worker))
        stop.daemon = True
        stop.start()
        try:
            figures = watch(worker, errors)
        finally:
            stop.cancel()
        if not errors:
            say(f"the post-copy resumed after {attempts} attempt{'s' if attempts > 1 else ''}")
            return figures
        exc = errors[0]
        last = (exc.get_error_message() if isinstance(exc, libvirt.libvirtError) else None) or str(exc)
        time.sleep(max(0.0, min(retry, deadline - time.monotonic())))


def attempt(dom: libvirt.virDomain, migration_uri: str, listen_there: Callable[[], object],
            say: Callable[[str], None], poll: float = POLL) -> None:
    """One try to resume: the other host's QEMU listens again (``listen_there``: ``POST /v1/live/{id}/recover``),
    then QEMU here reconnects through the tunnel's migration entrance (``migration_uri``, ``unix:///PATH``) and
    resumes (QMP ``migrate`` with ``resume``); it returns when the migration completed, and raises when it
    paused again or failed. libvirt's own resume (``VIR_MIGRATE_POSTCOPY_RESUME``) is not used: libvirt 11.3's
    prepare of a resume crashes the destination's libvirtd (a NULL read in ``qemuMigrationDstPrepare``), and
    QEMU needs no more than this; libvirt completes a post-copy QEMU resumed by itself, on both sides, as an
    unattended migration."""
    listen_there()
    path = urlsplit(migration_uri).path
    say("the other host listens again: resuming the post-copy")
    qmp.command(dom, "migrate", uri=f"unix:{path}", resume=True)
    while True:
        time.sleep(poll)
        try:
            status = qmp.command(dom, "query-migrate")
        except RuntimeFailure:
            if not _active(dom):
                return                     # completed: libvirt stopped the source (shut off, migrated)
            raise
        state = status.get("status") if isinstance(status, dict) else None
        if state == "completed":
            return
        if state in ("postcopy-paused", "failed", "cancelled"):
            raise RuntimeFailure(f"the resumed post-copy stopped again: QEMU's migration is {state}")


def _active(dom: libvirt.virDomain) -> bool:
    try:
        return bool(dom.isActive())
    except libvirt.libvirtError:
        return False


def _interrupt(dom: libvirt.virDomain, worker: threading.Thread) -> None:
    """A try still under way at the deadline is paused again: by libvirt, else by QEMU itself (the try was
    QEMU's, which libvirt may not count as its job), so that the try's wait for its end ends."""
    if not worker.is_alive():
        return
    try:
        dom.abortJobFlags(libvirt.VIR_DOMAIN_ABORT_JOB_POSTCOPY)
    except libvirt.libvirtError:
        with contextlib.suppress(RuntimeFailure):
            qmp.command(dom, "migrate-pause")


def _state(dom: libvirt.virDomain) -> str:
    try:
        return str(dom.state())
    except libvirt.libvirtError as exc:
        return exc.get_error_message()


def start_here(store: Store, name: str, say: Callable[[str], None]) -> str:
    """After :class:`PostcopyLost`: the half of the guest here (paused, its memory partly sent) is ended, its
    disks as they were at the switchover are kept as a version, and the capsule boots from that version here.
    The version's ref."""
    say(f"starting {name} again here from its disks as they were at the switchover")
    inst = store.catalogue.instance(name)
    if inst is None:
        raise RuntimeFailure(f"{name} has no instance here any more: its disks at the switchover are gone")
    sealed = instances.stop(store, name, force=True, timeout=0.0, note=NOTE)
    # nothing written since T0: the disks at the switchover are T0's version itself
    ref = sealed.version.ref if sealed.version is not None else f"{name}@{inst.version}"
    instances.start(store, ref, boot=True)
    return ref


__all__ = ["NOTE", "PostcopyLost", "resume", "start_here"]
