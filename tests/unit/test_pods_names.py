"""The pod layer's pure parts: names, addresses and their allocation (guest and host share them), the
host's CAPSULE/POD references, and the guest command line's JSON answer for a bad name."""

from __future__ import annotations

import ipaddress
import json

import pytest

from capsule.errors import Conflict, InvalidName
from capsule.pod import ops
from capsule.pod.errors import PodAddressClash, PodNameInvalid
from pods import names
from pods.__main__ import main as guest_main
from pods.names import PodError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("good", ["a", "web", "web-1", "a" * 31, "x9-"])
def test_good_pod_names(good):
    assert names.check_name(good) == good


@pytest.mark.parametrize("bad", ["", "Web", "1web", "-a", "a" * 32, "a/b", "a b", "a.b", "ä", "../x"])
def test_bad_pod_names_are_refused(bad):
    with pytest.raises(PodError, match="pod name") as err:
        names.check_name(bad)
    assert err.value.kind == "invalid_name"


def test_parse_ip_defaults_to_24_and_refuses_non_hosts():
    assert str(names.parse_ip("198.18.0.7")) == "198.18.0.7/24"
    assert str(names.parse_ip("198.18.4.9/22")) == "198.18.4.9/22"
    for bad in ("198.18.0.0/24", "198.18.0.255/24", "300.1.1.1", "198.18.0.5/31", "x", "198.18.0.5/33"):
        with pytest.raises(PodError) as err:
            names.parse_ip(bad)
        assert err.value.kind == "invalid_name", bad
    with pytest.raises(PodError, match="bridge") as err:
        names.parse_ip("198.18.0.1/24")
    assert err.value.kind == "ip_clash"


def test_allocate_takes_the_lowest_free_host_after_the_gateway():
    net = ipaddress.IPv4Network("198.18.0.0/29")
    assert str(names.allocate(set(), net)) == "198.18.0.2/29"
    used = {ipaddress.IPv4Address("198.18.0.2"), ipaddress.IPv4Address("198.18.0.4")}
    assert str(names.allocate(used, net)) == "198.18.0.3/29"
    full = {ipaddress.IPv4Address(f"198.18.0.{i}") for i in range(2, 7)}
    with pytest.raises(PodError, match="no free") as err:
        names.allocate(full, net)
    assert err.value.kind == "ip_clash"


def test_check_free_refuses_a_taken_address_and_an_overlapping_network():
    taken = {"web": ipaddress.IPv4Interface("198.18.0.2/24")}
    names.check_free(ipaddress.IPv4Interface("198.18.0.3/24"), taken)
    with pytest.raises(PodError, match="taken by pod 'web'"):
        names.check_free(ipaddress.IPv4Interface("198.18.0.2/24"), taken)
    with pytest.raises(PodError, match="overlaps"):
        names.check_free(ipaddress.IPv4Interface("198.18.0.9/16"), taken)


def test_host_veth_names_fit_the_kernel_limit_and_differ():
    a, b = names.host_veth("a" * 31), names.host_veth("a" * 30)
    assert len(a) <= 15 and len(b) <= 15 and a != b
    assert names.host_veth("web") == names.host_veth("web")  # a restore finds the same name


def test_host_refs_are_checked_before_any_guest_is_asked():
    assert ops.parse_ref("deb/web") == ("deb", "web")
    for bad in ("deb", "deb/", "/web", "deb/Web", "deb/web/x"):
        with pytest.raises(InvalidName):
            ops.parse_ref(bad)
    with pytest.raises(PodNameInvalid):
        ops.check_ip("198.18.0.0/24")
    with pytest.raises(PodAddressClash) as err:
        ops.check_ip("198.18.0.1/24")
    assert isinstance(err.value, Conflict)
    assert ops.check_ip("198.18.0.5") == "198.18.0.5/24"


def test_guest_command_line_answers_one_json_line(capsys):
    assert guest_main(["show", "Bad"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["kind"] == "invalid_name" and "Bad" in out["error"]
    assert guest_main(["version"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["version"]


def test_gc_keeps_pod_images(tmp_path):
    from capsule import hierarchy
    from capsule.pod import POD_IMAGE_ROLE
    from capsule.store import Store

    store = Store.open(tmp_path / "store")
    try:
        ids = {}
        for role in (POD_IMAGE_ROLE, "memory"):
            f = tmp_path / role
            f.write_bytes(role.encode() * 5000)
            row = store.seal_file(f, role)
            store.catalogue.add_file(row)
            ids[role] = row.id
        removed = hierarchy.gc(store).files
        assert removed == [ids["memory"]]
        assert store.catalogue.file(ids[POD_IMAGE_ROLE]) is not None
        assert store.file_path(ids[POD_IMAGE_ROLE]).exists()
    finally:
        store.close()
