"""update make's pure parts: the steps planned from the options, apt's "Need to get" figure, the NIC of an
update run in the domain XML, and the refusals that happen before any guest is booted."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capsule.errors import InvalidName
from capsule.runtime.domainxml import MachineSpec, build
from capsule.update.guest import need_to_get
from capsule.update.make import NETWORK, plan_steps

pytestmark = pytest.mark.unit


def test_apt_steps_come_first_then_the_commands_in_order():
    steps = plan_steps(["echo one", "echo two"], ["jq", "tree=2.1.0-1"], upgrade=True)
    labels = [s.label for s in steps]
    assert labels == ["apt-get update", "apt-get upgrade", "apt-get install jq tree=2.1.0-1", "echo one", "echo two"]
    assert steps[2].script.endswith("install jq tree=2.1.0-1")
    assert "--force-confold" in steps[1].script
    assert [s.label for s in plan_steps(["true"], [], upgrade=False)] == ["true"]


@pytest.mark.parametrize("bad", ["jq; rm -rf /", "$(reboot)", "Tree", "-y", ""])
def test_package_names_are_checked(bad):
    with pytest.raises(InvalidName, match="not Debian package names"):
        plan_steps([], [bad], upgrade=False)


def test_nothing_to_do_is_refused():
    with pytest.raises(InvalidName, match="nothing to do"):
        plan_steps([], [], upgrade=False)


def test_need_to_get_sums_every_apt_run():
    text = ("Need to get 389 kB of archives.\nAfter this operation, 1170 kB of additional disk space\n"
            "Need to get 0 B/1,234 kB of archives.\nNeed to get 12.5 MB of archives.\n")
    assert need_to_get(text) == 389_000 + 0 + 12_500_000
    assert need_to_get("nothing fetched") == 0


def _spec(**kw) -> MachineSpec:
    here = Path("/srv/store")
    return MachineSpec(name="capsule-x-web", uuid="0b6f3e53-2a52-4a1e-8a0e-9e1d3c7f0001", memory_mib=512, vcpus=1,
                       accel="tcg", kernel=here / "k", initrd=here / "i", cmdline="console=ttyS0",
                       disks=[here / "leaf-0.qcow2"], console_log=here / "c.log", agent_socket=here / "a.sock", **kw)


def test_an_update_run_has_a_user_mode_nic_and_other_runs_none():
    plain = ET.fromstring(build(_spec()))
    assert plain.find("devices/interface") is None
    dom = ET.fromstring(build(_spec(user_network=NETWORK)))
    nic = dom.find("devices/interface")
    assert nic is not None and nic.get("type") == "user"
    ip = nic.find("ip")
    assert ip is not None and (ip.get("address"), ip.get("prefix")) == ("192.0.2.0", "24")
    assert nic.find("model").get("type") == "virtio"
    # the disk takes discards: freed blocks reach the leaf
    assert dom.find("devices/disk/driver").get("discard") == "unmap"
