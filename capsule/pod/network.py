"""The pod network of a host (``runtime.podnet``): which running capsules of this store are on it, the pod
addresses in use on it, a free one for a new pod, and the clash check before a pod is restored onto it.

The rule: a pod address is unique among the pods of every running capsule of this store that is on the pod
network (a pod of another store's capsule on the same bridge is not seen; give such pods addresses by hand)."""

from __future__ import annotations

import ipaddress

from capsule.pod import replies
from capsule.pod.errors import PodAddressClash, PodLayerMissing
from capsule.pod.imagemeta import image_address
from capsule.pod.relay import Relay
from capsule.runtime.podnet import CONFIG_KEY
from capsule.store import Store
from pods.names import PodError, allocate

__all__ = ["addresses_in_use", "free_address", "image_address", "on_pod_network", "refuse_clash"]


def on_pod_network(store: Store, capsule: str) -> bool:
    inst = store.catalogue.instance(capsule)
    version = store.catalogue.version(capsule, inst.version) if inst else None
    return bool(version and version.config.get(CONFIG_KEY))


def addresses_in_use(store: Store, except_capsule: str | None = None) -> dict[ipaddress.IPv4Address, str]:
    """Address → ``CAPSULE/POD`` for the live pods of the running capsules on the pod network."""
    used: dict[ipaddress.IPv4Address, str] = {}
    for inst in store.catalogue.instances():
        if inst.capsule == except_capsule or not on_pod_network(store, inst.capsule):
            continue
        try:
            pods = replies.listed(Relay(store, inst.capsule).call("ls"), inst.capsule)
        except PodLayerMissing:
            continue
        for p in pods:
            if p["state"] != "exited":
                used[ipaddress.IPv4Interface(p["ip"]).ip] = f"{inst.capsule}/{p['name']}"
    return used


def free_address(store: Store) -> str:
    """The lowest address of the pods' /24 that no pod on the pod network holds."""
    try:
        return str(allocate(set(addresses_in_use(store))))
    except PodError as exc:
        raise PodAddressClash(f"the pod network: {exc}") from None


def refuse_clash(store: Store, ip: str, into: str, leaving: str | None = None) -> None:
    """Refuse to restore a pod holding ``ip`` into ``into`` while a pod of another capsule on the pod network
    holds it (``leaving``: the capsule the pod is being moved out of, where it holds it itself)."""
    if not on_pod_network(store, into):
        return
    holder = addresses_in_use(store, except_capsule=leaving).get(ipaddress.IPv4Interface(ip).ip)
    if holder is not None and not holder.startswith(f"{into}/"):
        raise PodAddressClash(f"{ip.split('/')[0]} is held by pod {holder} on this host's pod network; "
                              "the pod is not restored (it runs on where it was, if it still runs)")
