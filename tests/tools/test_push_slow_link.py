"""A push over a real shaped link (network namespaces, ``tbf``: testkit/netlink.py) whose whole upload
takes several times the client's timeout: the pacing (capsule/transfer/pacing.py) keeps only a few seconds' worth
of blocks in flight, so no upload times out and is sent again — the link carries the object's bytes once,
plus TCP/IP's own, and the client's own count of wire bytes says so too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from capsule import capsules, images
from capsule.store import Store
from testkit.fleetkit import new_version
from testkit.netlink import SlowLink

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
# in namespace A: push the capsule with a client whose requests time out after 5 s
PUSH = """
import json, sys
from pathlib import Path
from capsule import transfer
from capsule.store import Store
from hashcache.transport.http import HttpTransport
home, url, token, pin = sys.argv[1:5]
store = Store.open(Path(home))
r = transfer.push(store, "cap", url, token, transport=HttpTransport(url, token, timeout=5.0, fingerprint=pin))
print(json.dumps({"wire_bytes": r.wire_bytes}))
"""


def test_a_push_several_timeouts_long_sends_every_block_once(tmp_path, tiny_images):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    for s in (a, b):
        images.import_image(tiny_images, s, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    new_version(a, "cap", 4 * MiB, seed=9)     # random: zstd cannot shrink it
    a.close()
    b.close()
    token_file = tmp_path / "b.token"
    with SlowLink(rate_kbit=2000, rtt_ms=20) as link:      # 250 kB/s: the layer alone takes ~17 s
        url, pin = link.agent_b(tmp_path / "b", token_file)   # off loopback: TLS, its key pinned
        before = link.wire_bytes()
        out = link.exec_a([sys.executable, "-c", PUSH, str(tmp_path / "a"), url, token_file.read_text().strip(),
                           pin], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        on_link = link.wire_bytes() - before
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trying again" not in out.stderr and "timed out" not in out.stderr, out.stderr[-3000:]
    wire = json.loads(out.stdout.strip().splitlines()[-1])["wire_bytes"]
    assert 4 * MiB <= wire < 4.3 * MiB                  # the layer once, and every attempt counted
    assert on_link < 1.12 * wire, (on_link, wire)       # TCP/IP headers and ACKs, no resent upload
    b = Store.open(tmp_path / "b")
    assert b.catalogue.version("cap", 2) is not None
    b.close()
