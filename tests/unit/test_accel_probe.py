"""The KVM decision where the probe's guest cannot be booted: a probe image whose kernel or initrd is not on
disk (a store whose files are gone, or a test's store that records an image without its files) is TCG with
the reason, is no crash, and is not cached for the host (another store's probe decides)."""

from __future__ import annotations

import pytest

from capsule.runtime import accel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_probe_image_without_its_files_is_answered_tcg_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("CAPSULE_ACCEL", raising=False)
    monkeypatch.setattr(accel, "probe_kvm", lambda *a: pytest.fail("probed without a kernel"))
    kernel, initrd = tmp_path / "files" / "k", tmp_path / "files" / "i"
    cache = tmp_path / "accel.json"
    decision = accel.decide(cache, (kernel, initrd, "console=ttyS0", "MARK"))
    assert decision.accel == "tcg" and "missing" in decision.reason and str(kernel) in decision.reason
    assert not cache.exists()
