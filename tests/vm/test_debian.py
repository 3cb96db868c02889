"""The Debian image as a capsule: boots to its marker under libvirt, keeps a
file and a process across suspend/resume."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def test_debian_capsule_boots_suspends_and_resumes(debian_store):
    store = debian_store
    capsules.create(store, "deb", "debian", memory="512M")
    booted = lifecycle.start(store, "deb", timeout=300)
    assert booted.mode == "boot"
    assert run(store, "deb", "cat /etc/hostname") == "capsule-guest"
    run(store, "deb", "echo written-before > /root/note; sync")
    run(store, "deb", "sleep 100000 & echo $! > /tmp/sleeper")
    pid = run(store, "deb", "cat /tmp/sleeper")
    sealed = lifecycle.suspend(store, "deb")
    assert sealed.layers, "the guest wrote to its disk"
    lifecycle.start(store, "deb")
    assert run(store, "deb", "cat /root/note") == "written-before"
    assert run(store, "deb", f"kill -0 {pid} && echo alive") == "alive"
    assert run(store, "deb", "python3 -c 'print(6*7)'") == "42"
