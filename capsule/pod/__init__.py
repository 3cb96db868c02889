"""The host side of pods: a relay to the pod layer inside a capsule (``pods/``, through the guest
agent), the pod operations, and pod images as sealed file objects in the store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capsule.store import Store
    from capsule.store.catalogue import FileRow

POD_IMAGE_ROLE = "pod-image"  # the role of a pod image among the store's file objects
POD_GROUP_ROLE = "pod-group"  # a group image (capsule pod checkpoint-group): its members' pod images


def keep_sealed(store: Store, path: Path, role: str) -> FileRow:
    """Seal the finished file ``path`` (a pod image, a group record) in ``store`` and record it, once."""
    row = store.seal_file(path, role)
    with store.catalogue.transaction():
        if store.catalogue.file(row.id) is None:
            store.catalogue.add_file(row)
    return row
