"""Shared fixtures: an image store built once per machine (tiny, and Debian
on demand), fresh per-test stores that import those images, and clean-up of
every libvirt domain a test store started."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGE_HOME = Path(os.environ.get("CAPSULE_TEST_IMAGES", ROOT / ".cache" / "test-images"))


def _image_store():
    from capsule.store import Store

    return Store.open(IMAGE_HOME)


@pytest.fixture(scope="session")
def tiny_images():
    """The machine-wide test image store, with the tiny image built."""
    from capsule import images

    store = _image_store()
    images.build(store, "tiny", "tiny")
    return store


@pytest.fixture(scope="session")
def debian_images(tiny_images):
    from capsule import images

    images.build(tiny_images, "debian", "debian")
    return tiny_images


def _destroy_domains(store) -> None:
    import libvirt

    from capsule.runtime.connection import connect

    conn = connect()
    for dom in conn.listAllDomains():
        if dom.name().startswith(f"capsule-{store.id}-"):
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()


def make_store(path: Path, source, *images_to_import: str):
    from capsule import images
    from capsule.store import Store

    store = Store.open(path)
    for name in images_to_import:
        images.import_image(source, store, name)
    return store


@pytest.fixture
def store(tmp_path, tiny_images) -> Iterator:
    """A fresh store holding the tiny image."""
    s = make_store(tmp_path / "store", tiny_images, "tiny")
    yield s
    _destroy_domains(s)
    s.close()


@pytest.fixture
def debian_store(tmp_path, debian_images) -> Iterator:
    s = make_store(tmp_path / "store", debian_images, "debian", "tiny")
    yield s
    _destroy_domains(s)
    s.close()
