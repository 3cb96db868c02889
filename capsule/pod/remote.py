"""A pod moved to a capsule on another host (``capsule pod migrate CAPSULE/POD --to CAPSULE2 --on HOST``).

The target is checked first through the other host's agent (its capsule runs, has the pod layer, and
neither the pod's name nor its address is taken there); then the pod is checkpointed here (it stops, its
network locked), its image — a sealed file object — is pushed with HCP (blocks the other host holds stay
home), and that host's agent restores it into its capsule. Should the push or the restore fail, the pod is
restored here, where it was, and the error raised: it is never lost between the two hosts."""

from __future__ import annotations

import time
from typing import Any

from capsule import transfer
from capsule.agentclient import AgentClient
from capsule.errors import Error
from capsule.names import check_name as validate_capsule_name
from capsule.pod import ops
from capsule.pod.relay import Progress
from capsule.store import Store


def migrate(store: Store, ref: str, to: str, url: str, token: str, *, fingerprint: str | None = None,
            progress: Progress = None) -> dict[str, Any]:
    t0 = time.monotonic()
    capsule, pod = ops.parse_ref(ref)
    validate_capsule_name(to)
    from capsule import hosts

    pin = hosts.pin_for(store, url, fingerprint)
    with AgentClient(url, token, timeout=600.0, fingerprint=pin) as client:  # a restore copies the image in
        there = client.get_json("/v1/pods", capsule=to)
        ops.check_target(ops.source_pod(store, ref), there, to, ref)
        ck = ops.checkpoint(store, ref, progress=progress)
        try:
            if progress:
                progress("sending the image")
            sent = transfer.push_files(store, [(ck.image, ops.ROLE)], url, token, fingerprint=pin)
            if progress:
                progress("restoring there")
            moved = client.post_json("/v1/pods/restore", {"image": ck.image, "into": to})
        except Error:
            ops.restore(store, ck.image, capsule, progress=progress)  # the pod runs on where it was
            raise
    return {"pod": pod, "from": capsule, "to": to, "host": url, "image": ck.image, "size": ck.size,
            "wire_bytes": sent.wire_bytes, "found_there_bytes": sent.totals()["cache_bytes"],
            "checkpoint_seconds": ck.seconds, "send_seconds": round(sent.seconds, 3),
            "restore_seconds": moved["seconds"], "seconds": round(time.monotonic() - t0, 3),
            "state": moved["state"], "ip": moved["ip"]}
