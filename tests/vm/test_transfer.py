"""Moving running capsules between two local hosts with HCP."""

from __future__ import annotations

import pytest

from capsule import capsules, hosts, lifecycle, transfer
from tests.helpers.guest import COUNTER, count, disk_digest, run, wait_count_above, write_blocks

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("two_hosts", [True], ids=["tls"], indirect=True)
def test_push_suspended_capsule_and_resume_on_destination(two_hosts):
    """Over TLS, B's certificate pinned by an explicit fingerprint."""
    a, b, _agent_a, agent_b = two_hosts
    capsules.create(a, "mover", "tiny", memory="256M")
    lifecycle.start(a, "mover")
    run(a, "mover", COUNTER)
    run(a, "mover", "echo travelled > /tmp/note")
    before = wait_count_above(a, "mover", 5)
    sealed = lifecycle.suspend(a, "mover")
    assert agent_b.url.startswith("https://")
    report = transfer.push(a, "mover", agent_b.url, agent_b.token, fingerprint=agent_b.fingerprint)
    assert report.recorded and report.version == sealed.version.ref
    # the tiny image was already at B: only the memory image (and no layer: nothing was written) travels
    assert [o.role for o in report.objects] == ["memory"]
    resumed = lifecycle.start(b, "mover")
    assert resumed.mode == "restore"
    assert run(b, "mover", "cat /tmp/note") == "travelled"
    after = count(b, "mover")
    assert before <= after < before + 25
    assert wait_count_above(b, "mover", after) > after


@pytest.mark.parametrize("two_hosts", [True], ids=["tls"], indirect=True)
def test_child_after_parent_sends_only_new_objects(two_hosts):
    """Over TLS, B a known host: its pin comes from `host add`."""
    a, b, _agent_a, agent_b = two_hosts
    hosts.add(a, "b", agent_b.url, agent_b.token, fingerprint=agent_b.fingerprint)
    capsules.create(a, "base", "tiny", memory="256M")
    lifecycle.start(a, "base")
    write_blocks(a, "base", 100, 64)
    lifecycle.suspend(a, "base")
    first = transfer.push(a, "base", agent_b.url, agent_b.token)
    base_layer = a.catalogue.latest_version("base").chains[0][-1]
    assert base_layer in [o.id for o in first.objects]

    capsules.derive(a, "base", "child")
    lifecycle.start(a, "child")
    write_blocks(a, "child", 500, 16)
    digest = disk_digest(a, "child", blocks=1024)
    child = lifecycle.suspend(a, "child")
    second = transfer.push(a, "child", agent_b.url, agent_b.token)
    sent = {o.id for o in second.objects}
    assert sent == {child.layers[0].id, child.memory.id}
    assert base_layer in second.skipped
    layer_obj = next(o for o in second.objects if o.kind == "layer")
    assert layer_obj.raw_bytes == 16 * 4096

    again = transfer.push(a, "child", agent_b.url, agent_b.token)
    assert again.objects == [] and again.wire_bytes < 20_000
    lifecycle.start(b, "child")
    assert disk_digest(b, "child", blocks=1024) == digest


@pytest.mark.timeout(300)
def test_restore_on_destination_after_the_source_store_is_gone(two_hosts):
    """The image's XML names A's kernel, initrd and leaves: B restores with its own, so moving A's store away
    (as on a real second machine, where A's paths do not exist) changes nothing."""
    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "away", "tiny", memory="256M")
    lifecycle.start(a, "away")
    run(a, "away", COUNTER)
    before = wait_count_above(a, "away", 5)
    lifecycle.suspend(a, "away")
    transfer.push(a, "away", agent_b.url, agent_b.token)
    agent_a.stop()
    a.close()
    a.home.rename(a.home.with_name("a-moved"))
    resumed = lifecycle.start(b, "away")
    assert resumed.mode == "restore"
    after = count(b, "away")
    assert before <= after < before + 25
    assert wait_count_above(b, "away", after) > after
