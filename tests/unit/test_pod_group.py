"""Group images (capsule/pod/group.py) as the store holds them: found by a unique id prefix, parsed and
checked before anything is restored; a malformed or unknown one is refused clearly, and the arguments of a
group checkpoint are checked before any pod is touched (no guest is needed to refuse them)."""

from __future__ import annotations

import json

import pytest

from capsule.pod import POD_GROUP_ROLE, POD_IMAGE_ROLE, group
from capsule.pod.errors import PodFailed, PodNameInvalid, PodNotFound
from capsule.store import Store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _seal(store: Store, tmp_path, name: str, data: bytes, role: str) -> str:
    f = tmp_path / name
    f.write_bytes(data)
    row = store.seal_file(f, role)
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
    return row.id


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def test_a_group_image_is_read_by_prefix_and_checked(store, tmp_path):
    image = _seal(store, tmp_path, "pod", b"pod image bytes", POD_IMAGE_ROLE)
    record = {"format": 1, "made": 0, "members": [
        {"capsule": "a", "pod": "ping", "ip": "198.18.0.41/24", "image": image, "size": 15},
        {"capsule": "b", "pod": "pong", "ip": "198.18.0.42/24", "image": image, "size": 15}]}
    gid = _seal(store, tmp_path, "group", json.dumps(record).encode(), POD_GROUP_ROLE)
    got = group.read_group(store, gid[:8])
    assert got["id"] == gid and [m["pod"] for m in got["members"]] == ["ping", "pong"]
    with pytest.raises(PodNotFound, match="no group image"):
        group.read_group(store, "abcdef12")
    with pytest.raises(PodNameInvalid, match="at least 6 hex digits"):
        group.read_group(store, "../../x")
    with pytest.raises(PodNotFound, match="no pod 'other'"):
        group.restore_group(store, gid, {"other": "a"})


@pytest.mark.parametrize("bad", [
    b"not json",
    b'{"format": 2, "members": []}',
    b'{"format": 1, "members": [{"capsule": "a", "pod": "../x", "image": "00"}]}',
    b'{"format": 1, "members": [{"capsule": "a/b", "pod": "p", "image": "00"}]}',
    b'{"format": 1, "members": [{"capsule": "a", "pod": "p"}]}',
    b'{"format": 1, "members": [{"capsule": "a", "pod": "p", "image": "0123456789abcdef"}]}',
])
def test_a_malformed_group_image_is_refused_before_anything_restores(store, tmp_path, bad):
    gid = _seal(store, tmp_path, "group", bad, POD_GROUP_ROLE)
    with pytest.raises(PodFailed, match=f"group image {gid[:12]} is malformed"):
        group.read_group(store, gid)


@pytest.mark.parametrize(("refs", "message"), [
    (["a/ping"], "two pods or more"),
    (["a/ping", "a/ping"], "named twice"),
    (["a/ping", "b/ping"], "share a pod name"),
    (["a/ping", "nope"], "CAPSULE/POD"),
])
def test_a_bad_group_is_refused_before_any_pod_is_touched(store, refs, message):
    with pytest.raises(PodNameInvalid, match=message):
        group.checkpoint_group(store, refs)
