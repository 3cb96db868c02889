"""Restoring a memory image on this host: the machine comes from this host's template and the version's config
(this store's kernel and initrd, this instance's leaves, console log and agent socket, this host's emulator);
the image contributes only what its saved device state requires, checked against an allow-list
(``runtime.restorexml``). An image saved under another domain name or uuid is restored from a fork
(``runtime.saveimage.fork``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libvirt

from capsule.errors import RuntimeFailure
from capsule.runtime import guestaccess, podnet, restorexml, saveimage
from capsule.runtime.connection import connect
from capsule.runtime.domainxml import MachineSpec
from capsule.store import Store

VNC_SOCKET = "vnc.sock"  # the screen's VNC server, beside the agent socket in the instance's directory


@dataclass
class Restored:
    accel: str            # "kvm" or "tcg", as the image was saved
    forked: bool          # restored from a renamed copy of the image


def machine_spec(store: Store, config: dict[str, Any], *, name: str, uuid: str, accel: str, disks: list[Path],
                 console_log: Path, agent_socket: Path, emulator: str | None = None,
                 disk_servers: dict[int, Path] | None = None) -> MachineSpec:
    """This host's machine for a version's config."""
    return MachineSpec(name=name, uuid=uuid, memory_mib=config["memory_mib"], vcpus=config["vcpus"], accel=accel,
                       kernel=store.file_path(config["kernel"]), initrd=store.file_path(config["initrd"]),
                       cmdline=config["cmdline"], disks=disks, console_log=console_log, agent_socket=agent_socket,
                       free_page_reporting=config.get("free_page_reporting", True), emulator=emulator,
                       vnc_socket=agent_socket.with_name(VNC_SOCKET),
                       pod_uplink=(podnet.BRIDGE, podnet.uplink_mac(uuid)) if config.get(podnet.CONFIG_KEY) else None,
                       disk_servers=disk_servers or {})


def layer_files(store: Store, chains: list[list[str]]) -> list[list[Path]]:
    """For each disk's chain (layer ids, root first), its layer files nearest first: what a leaf on it may
    name below it."""
    return [[store.layer_path(lid) for lid in reversed(chain)] for chain in chains]


def grant(store: Store, spec: MachineSpec, chains: list[list[str]] | None = None) -> None:
    """Let the unprivileged QEMU user open what ``spec``'s machine needs (``runtime.guestaccess``): below each
    leaf only layers of its disk's chain in ``chains`` (the catalogue's), whatever the leaf's header names."""
    guestaccess.grant_machine(store.home, kernel=spec.kernel, initrd=spec.initrd, leaves=spec.disks,
                              instance_dir=spec.agent_socket.parent, sockets=list(spec.disk_servers.values()),
                              chains=None if chains is None else layer_files(store, chains))


def restore_spec(store: Store, config: dict[str, Any], saved_xml: str, *, name: str, uuid: str, disks: list[Path],
                 console_log: Path, agent_socket: Path, disk_servers: dict[int, Path] | None = None) -> MachineSpec:
    """This host's machine to restore ``saved_xml``'s state as (``restorexml.rebuild`` makes its XML)."""
    accel = restorexml.saved_accel(saved_xml)
    return machine_spec(store, config, name=name, uuid=uuid, accel=accel, disks=disks, console_log=console_log,
                        agent_socket=agent_socket, emulator=restorexml.host_emulator(accel), disk_servers=disk_servers)


def check(store: Store, config: dict[str, Any], image: Path, *, name: str, uuid: str, disks: int,
          instance_dir: Path) -> None:
    """Refuse an image whose XML this host would not restore, before any leaf or domain exists."""
    header = saveimage.read_header(image)
    placeholders = [instance_dir / f"disk{i}" for i in range(disks)]
    restorexml.rebuild(header.domain_xml, restore_spec(store, config, header.domain_xml, name=name, uuid=uuid,
                                                      disks=placeholders, console_log=instance_dir / "console.log",
                                                      agent_socket=instance_dir / "agent.sock"))


def restore(store: Store, label: str, config: dict[str, Any], image: Path, *, name: str, uuid: str,
            disks: list[Path], instance_dir: Path, disk_servers: dict[int, Path] | None = None,
            chains: list[list[str]] | None = None) -> Restored:
    """Restore ``image`` as domain ``name``/``uuid`` on ``disks`` (on the layers of ``chains``, as :func:`grant`).
    ``label`` names the version in errors."""
    header = saveimage.read_header(image)
    forked = False
    if saveimage.identity(header.domain_xml, image.name) != (name, uuid):
        fork = instance_dir / "memory.save"
        saveimage.fork(image, fork, name=name, uuid=uuid)
        image, forked = fork, True
        header = saveimage.read_header(image)
    try:
        spec = restore_spec(store, config, header.domain_xml, name=name, uuid=uuid, disks=disks,
                            console_log=instance_dir / "console.log", agent_socket=instance_dir / "agent.sock",
                            disk_servers=disk_servers)
        xml, accel = restorexml.rebuild(header.domain_xml, spec)   # IntegrityError before anything is granted
        grant(store, spec, chains)
        try:
            connect().restoreParams({libvirt.VIR_DOMAIN_SAVE_PARAM_FILE: str(image),
                                     libvirt.VIR_DOMAIN_SAVE_PARAM_DXML: xml}, 0)
        except libvirt.libvirtError as exc:
            raise RuntimeFailure(f"restoring {label} failed: {exc.get_error_message()}") from exc
    finally:
        if forked:
            image.unlink(missing_ok=True)  # QEMU has read it (or never will); the sealed original stays
    return Restored(accel, forked)
