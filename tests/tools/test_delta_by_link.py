"""HCP deltas picked by the link (capsule/transfer/deltapick.py), no codec or delta flag given: a version
whose blocks changed a little against a parent the receiver holds, pushed to real agents. Over a shaped
5 Mbit/s link (testkit/netlink.py) the pick uses deltas — the receivers' answers count the blocks they
rebuilt — and the push sends fewer bytes than with ``--no-deltas``; over loopback with no rate limit
the pick declines them, as the object's report says: after a trial, or before reading the versions' file
systems for one (what a trial costs at most)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from capsule import capsules, images, transfer
from capsule.store import Store
from capsule.store.catalogue import VersionRow
from capsule.store.objectio import has_object
from capsule.transfer import deltapick
from hashcache.blocks import BLOCK_SIZE
from testkit.fleetkit import new_version
from testkit.images import make_store
from testkit.netlink import SlowLink
from testkit.payloads import text
from tests.conftest import Agent

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SLICES = 16                                   # the changed blocks: sixteen slices of the pick (64 MiB)
SIZE = SLICES * deltapick.SLICE_BLOCKS * BLOCK_SIZE
# in namespace A: push version ``ref`` of the capsule, with or without deltas, and print the report
PUSH = """
import json, sys
from pathlib import Path
from capsule import transfer
from capsule.store import Store
from hashcache.transport.http import HttpTransport
home, ref, url, token, pin, deltas = sys.argv[1:7]
store = Store.open(Path(home))
r = transfer.push(store, ref, url, token, transfer.Options(deltas=deltas == "1"),
                  transport=HttpTransport(url, token, fingerprint=pin))
print(json.dumps(r.as_dict()))
"""


def _edited(data: bytes, seed: int) -> bytes:
    """``data`` with a few words rewritten in every block (a package update's version strings)."""
    rng = random.Random(seed)
    buf = bytearray(data)
    for b in range(0, len(buf), BLOCK_SIZE):
        for _ in range(3):
            at = b + rng.randrange(BLOCK_SIZE - 8)
            buf[at:at + 8] = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(8))
    return bytes(buf)


def _versions(store: Store) -> tuple[VersionRow, VersionRow]:
    """The capsule's version of text-like blocks, and its next with every one of them edited slightly."""
    capsules.create(store, "cap", "tiny", memory="256M")
    old = text(SIZE, 5)
    parent = new_version(store, "cap", SIZE, seed=0, content=old)
    child = new_version(store, "cap", SIZE, seed=1, content=_edited(old, 6))
    return parent, child


def _layer(report: dict, top: str) -> dict:
    return next(o for o in report["objects"] if o["id"] == top)


def test_a_slow_link_gets_deltas_and_fewer_bytes_than_without(tmp_path, tiny_images):
    a = Store.open(tmp_path / "a")
    images.import_image(tiny_images, a, "tiny")
    parent, child = _versions(a)
    top = child.chains[0][-1]
    a.close()
    homes = {"deltas": tmp_path / "b1", "whole": tmp_path / "b2"}
    for home in homes.values():
        b = Store.open(home)
        images.import_image(tiny_images, b, "tiny")
        b.close()
    reports = {}
    with SlowLink(rate_kbit=1_000_000, rtt_ms=2) as link:
        def push(ref: str, url: str, token: str, pin: str, deltas: bool) -> dict:
            p = link.spawn_a([sys.executable, "-c", PUSH, str(tmp_path / "a"), ref, url, token, pin,
                              "1" if deltas else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()[-3000:]
            return json.loads(out.decode().strip().splitlines()[-1])

        agents = {}
        for port, (label, home) in enumerate(homes.items(), start=7070):
            token_file = tmp_path / f"{label}.token"
            url, pin = link.agent_b(home, token_file, port=port)
            agents[label] = (url, token_file.read_text().strip(), pin)
            push(parent.ref, *agents[label], True)       # the parent, over a fast link
        link.set_rate(5_000)        # at 20 Mbit/s a loaded machine's delta CPU time once tied the link
        for label, (url, token, pin) in agents.items():
            reports[label] = push(child.ref, url, token, pin, label == "deltas")
    d, w = _layer(reports["deltas"], top), _layer(reports["whole"], top)
    print(f"5 Mbit/s: {d['wire_bytes']} wire bytes with deltas ({d['delta_blocks']} blocks, pick {d['deltas']}: "
          f"{d['delta_figures']}; {d['seconds']:.1f} s), {w['wire_bytes']} with --no-deltas ({w['codec']}; "
          f"{w['seconds']:.1f} s)")
    assert d["deltas"] == "used", d
    assert d["delta_figures"]["with_s_per_mb"] < d["delta_figures"]["without_s_per_mb"], d
    assert d["delta_blocks"] > deltapick.SLICE_BLOCKS, d       # more than a trial: later slices whole too
    assert w["delta_blocks"] == 0 and w["deltas"] == "", w
    # the first slices go whole while the link is measured, and how many depends on how busy this machine is (a
    # full suite's: 2.75 of 8); sixteen slices keep that share small enough for the saving to show
    assert d["wire_bytes"] < 0.85 * w["wire_bytes"], (d["wire_bytes"], w["wire_bytes"])
    for home in homes.values():
        b = Store.open(home)
        try:
            assert has_object(b, "layer", top) and b.catalogue.version("cap", child.number) is not None
        finally:
            b.close()


def test_on_loopback_the_pick_declines_deltas(tmp_path, tiny_images):
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    parent, child = _versions(a)
    top = child.chains[0][-1]
    b = make_store(tmp_path / "b", tiny_images, "tiny")
    agent = Agent(b.home, tmp_path / "b.token")
    try:
        transfer.push(a, parent.ref, agent.url, agent.token)
        r = transfer.push(a, child.ref, agent.url, agent.token)
        assert has_object(b, "layer", top) and b.layer_manifest(top).digest == top
    finally:
        agent.stop()
    o = next(o for o in r.objects if o.id == top)
    fig = o.delta_figures
    print(f"loopback: pick {o.deltas} on {fig}; {o.delta_blocks} blocks as deltas of {SIZE // BLOCK_SIZE}")
    assert o.deltas == "declined", (o.deltas, fig)
    if "open_s" in fig:   # reading the file systems alone would take too large a share of the push
        assert fig["open_s"] > deltapick.OPEN_SHARE * fig["whole_s"], fig
    else:                 # a trial: deltas send fewer bytes, but later
        assert fig["with_s_per_mb"] > fig["without_s_per_mb"] and fig["with_ratio"] < fig["without_ratio"], fig
    assert o.delta_blocks < (SLICES - 1) * deltapick.TRIAL_BLOCKS + 1, o   # trials only
