"""B3's peers: boot the same Debian capsule on host B from host A's disk layer exported by plain NBD.

* **plain NBD**: B's disk is a local qcow2 overlay whose backing is A's layer served by ``qemu-nbd``;
  every read of an unwritten block crosses the link, every boot again.
* **QEMU copy-on-read**: the same, with the drive's ``copy_on_read`` on: QEMU copies what it reads into
  the overlay, a whole overlay cluster (64 KiB, qemu-img's default) at a time.

Both fetch the kernel and initrd over the same link first (plain HTTP), as a demand-paged ``capsule run``
does. QEMU runs under libvirtd in the root namespace, so it reaches the export through a unix socket
that ``socat`` in namespace A forwards over the shaped link (testkit/netlink.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

from capsule.console.serial import wait_for_marker
from capsule.qemuimg import info as qemu_img_info
from capsule.runtime.accel import decide, default_cache
from capsule.runtime.connection import connect, lookup_domain
from capsule.runtime.domainxml import MachineSpec, build
from capsule.runtime.guestaccess import grant_machine
from capsule.store import Store

NBD_PORT = 10809
HTTP_PORT = 8088


class NbdPeers:
    """qemu-nbd and a file server in B (host A's side of the bench); boots in A (host B's side)."""

    def __init__(self, link, a: Store, capsule: str, work: Path) -> None:  # noqa: ANN001 (testkit.netlink.SlowLink)
        self.link = link
        self.work = work
        version = a.catalogue.latest_version(capsule)
        assert version is not None   # (the bench made it)
        self.config = version.config
        self.layer = a.layer_path(version.chains[0][-1])
        self.size = int(qemu_img_info(self.layer)["virtual-size"])
        link.spawn_b(["qemu-nbd", "--read-only", "--persistent", "--shared=16", "--format=qcow2", "--cache=none",
                      "--bind", link.ip_b, "--port", str(NBD_PORT), "--export-name", "disk", str(self.layer)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        link.spawn_b([sys.executable, "-m", "http.server", "--bind", link.ip_b, str(HTTP_PORT), "--directory",
                      str(a.home / "files")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        link.wait_port_b(NBD_PORT)
        link.wait_port_b(HTTP_PORT)
        self.socket = work / "nbd.sock"
        link.spawn_a(["socat", f"UNIX-LISTEN:{self.socket},fork,unlink-early",
                      f"TCP:127.0.0.1:{link.proxy_b(NBD_PORT)}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("socat did not open the NBD socket")
            time.sleep(0.05)

    def boot(self, case: str, copy_on_read: bool, timeout: float) -> tuple[float | None, int]:
        """Seconds to the boot marker (None: not within ``timeout``) and the bytes that crossed the link."""
        d = self.work / case.replace(" ", "-")
        d.mkdir()
        before = self.link.wire_bytes()
        start = time.monotonic()
        boot_files = {}
        for role in ("kernel", "initrd"):
            boot_files[role] = d / role
            self.link.exec_a(["curl", "-sSf", "-o", str(boot_files[role]),
                              f"{self.link.url_b(HTTP_PORT)}/{self.config[role]}"], check=True)
        overlay = d / "overlay.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b",
                        f"nbd+unix:///disk?socket={self.socket}", str(overlay), str(self.size)], check=True)
        name = f"capsule-bench-{uuid.uuid4().hex[:8]}"
        spec = MachineSpec(name=name, uuid=str(uuid.uuid4()), memory_mib=self.config["memory_mib"],
                           vcpus=self.config["vcpus"], accel=decide(default_cache(), None).accel,
                           kernel=boot_files["kernel"], initrd=boot_files["initrd"], cmdline=self.config["cmdline"],
                           disks=[overlay], console_log=d / "console.log", agent_socket=d / "agent.sock")
        dom = ET.fromstring(build(spec))
        if copy_on_read:
            for driver in dom.iter("driver"):
                driver.set("copy_on_read", "on")
        # QEMU runs as the guest user: let it reach the socket, the boot files and the overlay, and make its
        # sockets in the case's directory (as the store does for a capsule)
        grant_machine(self.work, kernel=boot_files["kernel"], initrd=boot_files["initrd"], leaves=[overlay],
                      instance_dir=d, sockets=[self.socket])
        domain = connect().createXML(ET.tostring(dom, encoding="unicode"), 0)
        try:
            wait_for_marker(d / "console.log", self.config["marker"], timeout, domain=name)
            seconds: float | None = time.monotonic() - start
        except Exception:  # noqa: BLE001 - a peer that does not boot in time is a result, not a crash
            seconds = None
        finally:
            moved = self.link.wire_bytes() - before
            if lookup_domain(name) is not None:
                domain.destroy()
        return seconds, moved
