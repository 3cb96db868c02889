"""Guest images in the store: build (tiny, debian, desktop) and list. An image is a
sealed root layer plus a sealed kernel and initrd for direct boot."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from capsule import qemuimg
from capsule.errors import AlreadyExists, CapsuleError, InvalidName, RuntimeFailure
from capsule.imagebuild import BuiltImage, ImageBuildError, build_debian, build_desktop, build_tiny
from capsule.imagebuild.common import recipe_sha256
from capsule.names import check_name
from capsule.store import Store
from capsule.store.catalogue import ImageRow
from capsule.store.modes import OBJECT_MODE

KINDS = ("tiny", "debian", "desktop")
DEFAULT_DISK_SIZE = {"debian": "2G", "desktop": "3G"}
Say = Callable[[str], None]


def image_cache_dir(store: Store) -> Path:
    env = os.environ.get("CAPSULE_IMAGE_CACHE")
    return Path(env) if env else store.home / "cache"


def build(store: Store, kind: str, name: str, *, rebuild: bool = False, say: Say = lambda _m: None,
          disk_size: str | None = None) -> tuple[ImageRow, bool]:
    """Build image ``name`` of ``kind``; a no-op returning (row, False) when it
    already exists unless ``rebuild``. ``disk_size``: the root disk of a debian
    or desktop image (default ``DEFAULT_DISK_SIZE``)."""
    check_name(name, "image")
    if kind not in KINDS:
        raise InvalidName(f"unknown image kind {kind!r}: choose one of {', '.join(KINDS)}")
    existing = store.catalogue.image(name)
    if existing is not None and not rebuild:
        if existing.kind != kind:
            raise AlreadyExists(f"image {name!r} already exists and is a {existing.kind} image")
        return existing, False
    cache = image_cache_dir(store)
    cache.mkdir(parents=True, exist_ok=True)
    work = store.temp_path(f"-build-{kind}")
    work.mkdir()
    old_env = os.environ.get("CAPSULE_IMAGE_CACHE")
    os.environ["CAPSULE_IMAGE_CACHE"] = str(cache)
    try:
        t0 = time.monotonic()
        try:
            built = _build(kind, work, say, disk_size or DEFAULT_DISK_SIZE.get(kind, "2G"))
        except ImageBuildError as exc:
            raise RuntimeFailure(f"building the {kind} image failed: {exc}") from exc
        build_seconds = time.monotonic() - t0
        return _install(store, name, kind, built, build_seconds, say), True
    finally:
        if old_env is None:
            os.environ.pop("CAPSULE_IMAGE_CACHE", None)
        else:
            os.environ["CAPSULE_IMAGE_CACHE"] = old_env
        shutil.rmtree(work, ignore_errors=True)


def _build(kind: str, work: Path, say: Say, disk_size: str) -> BuiltImage:
    if kind == "tiny":
        return build_tiny(work, progress=say)
    if kind == "desktop":
        return build_desktop(work, progress=say, disk_size=disk_size)
    return build_debian(work, progress=say, disk_size=disk_size)


def _install(store: Store, name: str, kind: str, built: BuiltImage, build_seconds: float, say: Say) -> ImageRow:
    with store.lock():
        say("converting the root disk to a qcow2 layer")
        leaf = store.new_leaf_path()
        try:
            qemuimg.convert_raw_to_layer(built.disk_raw, leaf)
            say("hashing the root layer")
            layer = store.seal_layer(leaf, None)
        except CapsuleError:
            leaf.unlink(missing_ok=True)
            raise
        files = {}
        for role, src in (("kernel", built.kernel), ("initrd", built.initrd)):
            tmp = store.temp_path(f".{role}")
            shutil.copyfile(src, tmp)
            files[role] = store.seal_file(tmp, role)
        info = dict(built.info)
        info["build_seconds"] = round(build_seconds, 1)
        info["recipe_sha256"] = recipe_sha256()
        row = ImageRow(name=name, kind=kind, root_layer=layer.id, kernel=files["kernel"].id,
                       initrd=files["initrd"].id, cmdline=built.cmdline, marker=built.marker, info=info,
                       created=time.time())
        cat = store.catalogue
        with cat.transaction():
            cat.add_layer(layer)
            for f in files.values():
                cat.add_file(f)
            cat.add_image(row)
        return row


def list_images(store: Store) -> list[ImageRow]:
    return store.catalogue.images()


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + ".importing")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    tmp.chmod(OBJECT_MODE)  # a hard link shares its mode with the source store's object
    os.rename(tmp, dst)


def import_image(src: Store, dst: Store, name: str) -> ImageRow:
    """Copy image ``name`` (its sealed objects, hard-linked when both stores
    share a file system) from another store on this machine."""
    check_name(name, "image")
    row = src.catalogue.image(name)
    if row is None:
        raise InvalidName(f"store {src.home} has no image {name!r}")
    existing = dst.catalogue.image(name)
    if existing is not None:
        if existing.root_layer != row.root_layer:
            raise AlreadyExists(f"this store already has a different image named {name!r}")
        return existing
    with dst.lock():
        layer = src.catalogue.layer(row.root_layer)
        files = [src.catalogue.file(fid) for fid in (row.kernel, row.initrd)]
        if layer is None or None in files:
            raise RuntimeFailure(f"image {name!r} in {src.home} is incomplete")
        _link_or_copy(src.layer_manifest_path(layer.id), dst.layer_manifest_path(layer.id))
        _link_or_copy(src.layer_path(layer.id), dst.layer_path(layer.id))
        for f in files:
            assert f is not None
            _link_or_copy(src.file_manifest_path(f.id), dst.file_manifest_path(f.id))
            _link_or_copy(src.file_path(f.id), dst.file_path(f.id))
        with dst.catalogue.transaction():
            dst.catalogue.add_layer(layer)
            for f in files:
                assert f is not None
                dst.catalogue.add_file(f)
            dst.catalogue.add_image(row)
        return row
