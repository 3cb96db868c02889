"""capsule migrate between two local hosts: full copy and demand paging."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.migrate import migrate
from capsule.runtime.connection import lookup_domain
from tests.vm.helpers import COUNTER, count, run, wait_count_above

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("mode", ["full", "demand"])
def test_migrate_keeps_the_guest_running(two_hosts, mode):
    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "m", "tiny", memory="256M")
    lifecycle.start(a, "m")
    run(a, "m", COUNTER)
    run(a, "m", "dd if=/dev/urandom of=/dev/vda bs=4096 seek=700 count=16 conv=notrunc 2>/dev/null; sync")
    before = wait_count_above(a, "m", 5)
    r = migrate(a, "m", agent_b.url, agent_b.token, mode=mode, balloon="cache",
                source_url=agent_a.url, source_token=agent_a.token)
    assert r.remote["mode"] == "restore"
    assert lookup_domain(a.domain_name("m")) is None
    assert lookup_domain(b.domain_name("m")) is not None
    after = count(b, "m")
    assert before <= after < before + 30
    assert wait_count_above(b, "m", after) > after
    if mode == "demand":
        assert r.push is None and r.remote["remote_layers"]  # the written layer stayed at A
    else:
        assert r.push is not None and any(o.kind == "layer" for o in r.push.objects)
