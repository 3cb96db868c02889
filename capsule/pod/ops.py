"""Pod operations, one library call per CLI verb: a pod is named ``CAPSULE/POD``; its image (after
``checkpoint``) is a sealed file object of role ``pod-image`` in this host's store, so it travels
with HCP like any memory image."""

from __future__ import annotations

import contextlib
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from capsule.errors import Error
from capsule.names import check_name as validate_capsule_name
from capsule.pod import POD_IMAGE_ROLE, direct, keep_sealed, replies
from capsule.pod import network as podnet
from capsule.pod.errors import (
    BY_KIND,
    PodAddressClash,
    PodExists,
    PodLayerMissing,
    PodLayerOutdated,
    PodNameInvalid,
    PodNotFound,
)
from capsule.pod.relay import LEND_FROM_IN, Progress, Relay
from capsule.runtime.hotdisk import HotDiskUnavailable
from capsule.store import Store
from pods.names import PodError, check_name, parse_ip

ROLE = POD_IMAGE_ROLE
GUEST_INBOX = "/var/lib/pods/in"


def parse_ref(ref: str) -> tuple[str, str]:
    """``CAPSULE/POD`` → (capsule, pod), both checked."""
    capsule, sep, pod = ref.partition("/")
    if not sep or not capsule or not pod:
        raise PodNameInvalid(f"{ref!r}: name a pod as CAPSULE/POD")
    validate_capsule_name(capsule)
    return capsule, check_pod_name(pod)


def check_pod_name(name: str) -> str:
    try:
        return check_name(name)
    except PodError as exc:
        raise PodNameInvalid(str(exc)) from None


def check_ip(ip: str | None) -> str | None:
    if ip is None:
        return None
    try:
        return str(parse_ip(ip))
    except PodError as exc:
        raise BY_KIND.get(exc.kind, PodNameInvalid)(str(exc)) from None


def create(store: Store, capsule: str, pod: str, cmd: list[str], ip: str | None = None) -> dict[str, Any]:
    validate_capsule_name(capsule)
    check_pod_name(pod)
    ip = check_ip(ip)
    if not cmd:
        raise PodNameInvalid("a pod needs a command: capsule pod create CAPSULE POD -- CMD…")
    if podnet.on_pod_network(store, capsule):  # the address must be free on the whole pod network
        if ip is None:
            ip = podnet.free_address(store)
        else:
            podnet.refuse_clash(store, ip, capsule)
    extra = ["--ip", ip] if ip else []
    # (a first create in a capsule starts python, sets up the bridge and the cgroup: slow on a busy TCG guest)
    return replies.tagged(capsule, Relay(store, capsule).call("create", *extra, pod, "--", *cmd, timeout=180), "create")


def exec_in(store: Store, ref: str, cmd: list[str], timeout: float = 30.0) -> dict[str, Any]:
    capsule, pod = parse_ref(ref)
    if not cmd:
        raise PodNameInvalid("nothing to run: capsule pod exec CAPSULE/POD -- CMD…")
    return replies.tagged(capsule, Relay(store, capsule).call("exec", "--timeout", str(timeout), pod, "--", *cmd,
                                                              timeout=timeout + 10), "exec")


def ls(store: Store, capsule: str | None = None) -> list[dict[str, Any]]:
    """The pods of one running capsule, or of every running capsule of this store that has the pod layer."""
    if capsule:
        validate_capsule_name(capsule)
        return [replies.tagged(capsule, p, "ls") for p in listed(Relay(store, capsule), capsule)]
    out = []
    for inst in store.catalogue.instances():
        try:
            out += [replies.tagged(inst.capsule, p, "ls") for p in listed(Relay(store, inst.capsule), inst.capsule)]
        except PodLayerMissing:
            continue  # a guest without pods (the tiny image) has none to list
    return out


def listed(relay: Relay, capsule: str) -> list[dict[str, Any]]:
    """The pods of a running capsule, as its pod layer lists them (checked: ``replies.listed``)."""
    return replies.listed(relay.call("ls"), capsule)


def _verb(store: Store, verb: str, ref: str) -> dict[str, Any]:
    capsule, pod = parse_ref(ref)
    return replies.tagged(capsule, Relay(store, capsule).call(verb, pod), verb)


def suspend(store: Store, ref: str) -> dict[str, Any]:
    return _verb(store, "suspend", ref)


def resume(store: Store, ref: str) -> dict[str, Any]:
    return _verb(store, "resume", ref)


def kill(store: Store, ref: str) -> dict[str, Any]:
    return _verb(store, "kill", ref)


@dataclass
class CheckpointResult:
    capsule: str
    pod: str
    image: str          # the sealed file object's id
    size: int
    ip: str
    left_running: bool
    dump_seconds: float      # CRIU's dump in the guest
    guest_seconds: float     # dump + archive in the guest
    copy_seconds: float      # guest → store
    copy_calls: int
    seconds: float
    guest_steps: dict[str, float] = field(default_factory=dict)   # the guest's seconds per step
    copy_route: str = "file"   # "direct": packed straight onto a lent disk; "file": a file in the guest, copied

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint(store: Store, ref: str, *, leave_running: bool = False, progress: Progress = None
               ) -> CheckpointResult:
    """Dump the pod with CRIU in its capsule, copy the image here and seal it. Without ``leave_running``
    the pod stops at the dump (its network locked, so its TCP peers wait); should the copy or the seal
    fail, it is restarted in its capsule from the image still there."""
    t0 = time.monotonic()
    capsule, pod = parse_ref(ref)
    relay = Relay(store, capsule)
    if progress:
        progress("dumping")
    with relay.session():
        return _checkpoint(store, relay, capsule, pod, leave_running, progress, t0)


def image_cap(store: Store, capsule: str) -> int:
    """The largest pod image capsule ``capsule`` (running) may hand this host (``replies.image_cap``)."""
    inst = store.catalogue.instance(capsule)
    version = store.catalogue.version(capsule, inst.version) if inst else None
    if version is None:
        raise PodNotFound(f"capsule {capsule!r} is not running here")
    return replies.image_cap(int(version.config["memory_mib"]))


def _checkpoint(store: Store, relay: Relay, capsule: str, pod: str, leave_running: bool, progress: Progress,
                t0: float) -> CheckpointResult:
    cap = image_cap(store, capsule)
    lend: bool | None = None
    try:
        d = direct.checkpoint(store, relay, capsule, pod, leave_running, cap, progress)
    except PodLayerOutdated:
        pass   # a pod layer before "direct": the image goes through a file in the guest
    except HotDiskUnavailable:
        lend = False   # a guest that takes no lent disk: through a file and the agent's channel
    else:
        p = d.placed
        return CheckpointResult(capsule, pod, d.row.id, d.row.size, p.ip, leave_running, p.dump_seconds,
                                p.seconds, d.copy_seconds, 1, round(time.monotonic() - t0, 3), p.steps, "direct")
    result = relay.call("checkpoint", pod, *(["--leave-running"] if leave_running else []), timeout=180)
    path = replies.image_path(result, capsule, pod)   # a path it did not ask about: nothing of it is touched
    try:
        dumped = replies.dumped(result, capsule, pod, cap)   # a size over the cap: nothing is made or copied
        replies.check_room(store.tmp_dir, dumped.size)
    except Error:
        with contextlib.suppress(Error):   # the pod runs on where it was; its image goes
            if not leave_running:
                relay.call("restore", path, timeout=180)
            relay.sh(f"rm -f {shlex.quote(path)}")
        raise
    tmp = store.temp_path(".pod.tar.zst")
    done = False
    try:
        t1 = time.monotonic()
        calls = relay.download(dumped.path, dumped.size, tmp, progress, lend=lend)
        copy_seconds = time.monotonic() - t1
        row = keep_sealed(store, tmp, ROLE)
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        if not done and not leave_running:
            relay.call("restore", dumped.path, timeout=180)  # the pod runs on where it was
        relay.sh(f"rm -f {shlex.quote(dumped.path)}")
    return CheckpointResult(capsule, pod, row.id, row.size, dumped.ip, leave_running, dumped.dump_seconds,
                            dumped.seconds, round(copy_seconds, 3), calls, round(time.monotonic() - t0, 3),
                            dumped.steps)


def resolve_image(store: Store, ref: str) -> str:
    """A pod image by its id or a unique prefix of it (at least 6 hex digits)."""
    if len(ref) < 6 or any(c not in "0123456789abcdef" for c in ref):
        raise PodNameInvalid(f"{ref!r}: a pod image is named by its id (at least 6 hex digits)")
    hits = [f.id for f in store.catalogue.files() if f.role == ROLE and f.id.startswith(ref)]
    if not hits:
        raise PodNotFound(f"no pod image {ref!r} in this store (`capsule pod checkpoint` makes one)")
    if len(hits) > 1:
        raise PodNameInvalid(f"{ref!r} names {len(hits)} pod images; give more digits")
    return hits[0]


def restore(store: Store, image: str, into: str, progress: Progress = None, *, leaving: str | None = None,
            check_network: bool = True) -> dict[str, Any]:
    """Restart a pod from its image in a running capsule (the one it came from or another). On the pod
    network, refused while a pod of another capsule there holds its address (``leaving``: the capsule a
    migration moves it out of)."""
    t0 = time.monotonic()
    file_id = resolve_image(store, image)
    validate_capsule_name(into)
    relay = Relay(store, into)
    if check_network and podnet.on_pod_network(store, into):
        podnet.refuse_clash(store, podnet.image_address(store.file_path(file_id)), into, leaving)
    guest_path = f"{GUEST_INBOX}/{file_id}.pod"
    if progress:
        progress("copying the image in")
    image_path = store.file_path(file_id)
    lend: bool | None = None
    route = "file"
    with relay.session():
        result = None
        if image_path.stat().st_size >= LEND_FROM_IN and direct.can_restore(image_path):
            try:
                got, copy_seconds = direct.restore(relay, image_path, progress)
                result, calls, route = replies.restored(got, into), 1, "direct"
            except PodLayerOutdated:
                pass   # a pod layer before "direct": through a file in the guest
            except HotDiskUnavailable:
                lend = False   # a guest that takes no lent disk: through the agent's channel
        if result is None:
            calls = relay.upload(image_path, guest_path, progress, lend=lend)
            copy_seconds = time.monotonic() - t0
            if progress:
                progress("restoring")
            try:
                result = replies.restored(relay.call("restore", guest_path, timeout=180), into)
            finally:
                relay.sh(f"rm -f {guest_path}")
    result = {k: v for k, v in result.items() if k not in ("capsule", "image")}
    return {"capsule": into, "image": file_id, **result, "copy_seconds": round(copy_seconds, 3),
            "copy_calls": calls, "copy_route": route, "seconds": round(time.monotonic() - t0, 3)}


def source_pod(store: Store, ref: str) -> dict[str, Any]:
    """The pod ``CAPSULE/POD`` as its capsule lists it (name, address, state …)."""
    capsule, pod = parse_ref(ref)
    source = {p["name"]: p for p in listed(Relay(store, capsule), capsule)}
    if pod not in source:
        raise PodNotFound(f"capsule {capsule!r}: no pod {pod!r} in this capsule")
    return source[pod]


def check_target(pod: dict[str, Any], there: list[dict[str, Any]], to: str, ref: str) -> None:
    """Refuse, before anything stops, a move of ``pod`` into capsule ``to`` whose pods (``there``) hold its
    name or its address."""
    for other in there:
        if other["state"] == "exited":
            continue
        if other["name"] == pod["name"]:
            raise PodExists(f"capsule {to!r}: a pod {pod['name']!r} runs there already; {ref} stays where it is")
        if other["ip"].split("/")[0] == pod["ip"].split("/")[0]:
            raise PodAddressClash(f"capsule {to!r}: pod {other['name']!r} holds {other['ip']}; "
                                  f"{ref} stays where it is")


def migrate(store: Store, ref: str, to: str, progress: Progress = None) -> dict[str, Any]:
    """Move a pod to another running capsule of this host: checkpoint (the pod stops), restore there.
    The target is checked first (the name free, the address free in it and on the pod network); should
    the restore still fail, the pod is restored in its own capsule again and the error raised. Between
    capsules on the pod network (``capsule create --pod-network``) its peers' TCP connections follow it."""
    t0 = time.monotonic()
    capsule, pod = parse_ref(ref)
    validate_capsule_name(to)
    if to == capsule:
        raise PodNameInvalid(f"pod {ref} is in {to!r} already")
    source = source_pod(store, ref)
    check_target(source, listed(Relay(store, to), to), to, ref)
    podnet.refuse_clash(store, source["ip"], to, leaving=capsule)
    ck = checkpoint(store, ref, progress=progress)
    try:
        moved = restore(store, ck.image, to, progress=progress, leaving=capsule)
    except Error:
        restore(store, ck.image, capsule, progress=progress, check_network=False)  # it runs on where it was
        raise
    return {"pod": pod, "from": capsule, "to": to, "image": ck.image, "size": ck.size,
            "checkpoint_seconds": ck.seconds, "restore_seconds": moved["seconds"],
            "seconds": round(time.monotonic() - t0, 3), "state": moved["state"], "ip": moved["ip"]}
