"""The test image store and stores made from it, for the tests' fixtures and the benchmarks: the
machine-wide store of built test images, an image built once into it (again when stale: keyed by what
it carries), a fresh store importing images from it, and clean-up of every libvirt domain a store started.

The store of test images lives outside any clone, so a second clone, or a fresh one on the same machine,
finds the images built: ``CAPSULE_TEST_IMAGES``; else, for root, /var/cache/capsule/test-images (QEMU,
which runs unprivileged, must reach it: not under /root); else ``$XDG_CACHE_HOME/capsule/test-images``."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _image_home() -> Path:
    if env := os.environ.get("CAPSULE_TEST_IMAGES"):   # set but empty counts as unset, not as "here"
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/capsule/test-images")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capsule" / "test-images"


IMAGE_HOME = _image_home()


def image_store():
    from capsule.store import Store

    return Store.open(IMAGE_HOME)


def ensure_image(store, kind: str) -> None:
    """Build the image once; again when the guest agent (or, in Debian, the pod layer) it carries is not
    the current one, or when the recipes (capsule/imagebuild/) changed. One process builds at a time (the
    suite's light tiers and its two guest processes share the store): the others wait, then find it built."""
    from capsule import images
    from capsule.imagebuild.common import agent_binary, agent_info, pod_layer_sha256, recipe_sha256

    with _build_lock(store.home):
        row = store.catalogue.image(kind)
        stale = row is not None and (row.info.get("agent_sha256") != agent_info(agent_binary())["sha256"]
                                     or row.info.get("recipe_sha256") != recipe_sha256()
                                     or (kind == "debian" and row.info.get("pods_sha256") != pod_layer_sha256()))
        images.build(store, kind, kind, rebuild=stale)


@contextlib.contextmanager
def _build_lock(home: Path) -> Iterator[None]:
    """An exclusive lock beside the image store (not in it: a store holds only its own files)."""
    with open(home.parent / f".{home.name}.build-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def destroy_domains(store) -> None:
    """After a test: destroy the store's libvirt domains, and stop the disk servers its instances had (a
    demand-paged run's outlive the process that started them, as they must for a running guest)."""
    import libvirt

    from capsule.lifecycle import demand
    from capsule.runtime.connection import connect

    conn = connect()
    for dom in conn.listAllDomains():
        if dom.name().startswith(f"capsule-{store.id}-"):
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
    for inst_dir in sorted(store.instances_dir.glob("*")):
        demand.stop_servers(inst_dir)


def make_store(path: Path, source, *images_to_import: str):
    from capsule import images
    from capsule.store import Store

    store = Store.open(path)
    for name in images_to_import:
        images.import_image(source, store, name)
    return store
