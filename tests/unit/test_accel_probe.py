"""The KVM probe where its guest cannot be booted: a probe image whose kernel or initrd is not on disk (a store
whose files are gone, or a test's store that records an image without its files) is no KVM and no crash."""

from __future__ import annotations

import pytest

from capsule.runtime import accel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_probe_image_without_its_files_is_answered_tcg_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(accel.os.path, "exists", lambda p: p == "/dev/kvm")
    monkeypatch.setattr(accel.os, "access", lambda p, mode: True)
    kernel, initrd = tmp_path / "files" / "k", tmp_path / "files" / "i"
    ok, why = accel.probe_kvm(kernel, initrd, "console=ttyS0", "MARK", timeout=1)
    assert not ok and "missing" in why and str(kernel) in why and str(initrd) in why
