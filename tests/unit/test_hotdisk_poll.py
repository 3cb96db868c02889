"""A lent disk is looked for in the guest soon after its attach: first after 10 ms, the pause doubling
to at most 200 ms, so a guest that shows the device within a few tens of ms is not kept waiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsule.runtime import hotdisk

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class _Domain:
    def __init__(self) -> None:
        self.attached = False

    def XMLDesc(self, _flags: int) -> str:  # noqa: N802 - libvirt's name
        return "<domain><devices><disk><target dev='vda'/></disk></devices></domain>"

    def attachDeviceFlags(self, _xml: str, _flags: int) -> None:  # noqa: N802
        self.attached = True

    def detachDeviceFlags(self, _xml: str, _flags: int) -> None:  # noqa: N802
        self.attached = False


def test_the_guest_is_asked_for_the_device_soon_then_less_often(tmp_path: Path, monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(hotdisk.time, "sleep", pauses.append)
    monkeypatch.setattr(hotdisk.guestaccess, "lend", lambda path, writable: None)
    asked: list[str] = []

    def guest_has(device: str) -> bool:
        asked.append(device)
        return len(asked) > 8   # seen on the ninth look

    (tmp_path / "f").write_bytes(b"x" * 512)
    with hotdisk.HotDisk(_Domain(), tmp_path / "f", guest_has) as disk:  # type: ignore[arg-type]
        assert asked[-1] == disk.guest_device
    assert pauses[0] <= 0.01 and sum(pauses[:3]) <= 0.1   # three looks within 0.1 s of the attach
    assert max(pauses) == 0.2 and pauses == sorted(pauses)
    assert len(pauses) == 8
