"""Block uploads as one zstd or xz stream per object between two real agents: a push at a high zstd level
sends an object whose batches resemble each other in a fraction of the bytes that a frame per batch
takes, and a push with xz; a push whose stream the receiver lost starts a new one and completes (the
receiver's and sender's rules in-process are in tests/unit/test_object_streams.py)."""

from __future__ import annotations

import random

import pytest

from capsule import capsules, transfer
from capsule.exchange.streams import ObjectStreamLost
from capsule.store.objectio import has_object
from capsule.transfer import pushing
from hashcache.blocks import BLOCK_SIZE
from testkit.fleetkit import new_version
from testkit.images import make_store
from tests.conftest import Agent


@pytest.mark.tools
@pytest.mark.timeout(300)
def test_a_high_level_push_of_similar_batches_sends_a_fraction_of_the_frames_bytes(tmp_path, tiny_images, monkeypatch):
    """4 MiB of 16 near-copies of one 256 KiB piece (every 4 KiB block differs, so none is deduplicated):
    frames of 1 MiB each hold 4 copies, the stream holds them all."""
    rng = random.Random(5)
    piece = rng.randbytes(256 << 10)
    copies = []
    for c in range(16):
        buf = bytearray(piece)
        for b in range(0, len(buf), BLOCK_SIZE):
            buf[b + rng.randrange(BLOCK_SIZE)] ^= c + 1
        copies.append(bytes(buf))
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    version = new_version(a, "cap", 4 << 20, seed=0, content=b"".join(copies))
    from capsule.agentclient import AgentClient

    codecs: set[str] = set()
    real = AgentClient.request

    def request(self, method, path, **kw):  # type: ignore[no-untyped-def]
        codecs.add((kw.get("params") or {}).get("codec", "frame"))
        return real(self, method, path, **kw)

    monkeypatch.setattr(AgentClient, "request", request)
    wire, used = {}, {}
    for label, stream_level, opts in (("frames", 100, transfer.Options(level=19)),
                                      ("stream", pushing.STREAM_LEVEL, transfer.Options(level=19)),
                                      ("xz", 100, transfer.Options(xz=True))):
        b = make_store(tmp_path / label, tiny_images, "tiny")
        agent = Agent(b.home, tmp_path / f"{label}.token")
        codecs.clear()
        try:
            monkeypatch.setattr(pushing, "STREAM_LEVEL", stream_level)
            r = transfer.push(a, version.ref, agent.url, agent.token, opts)
            used[label] = codecs - {"frame"}
            layer = version.chains[0][-1]
            assert has_object(b, "layer", layer) and b.layer_manifest(layer).digest == layer
            wire[label] = next(o for o in r.objects if o.id == layer).wire_bytes
        finally:
            agent.stop()
    print(f"wire bytes of the layer at zstd -19 and as xz: {wire}")
    assert used == {"frames": set(), "stream": {"zstd"}, "xz": {"xz"}}, used
    assert wire["stream"] < 0.5 * wire["frames"], wire
    assert wire["xz"] < 0.5 * wire["frames"], wire


@pytest.mark.tools
@pytest.mark.timeout(300)
def test_a_push_whose_stream_the_receiver_lost_starts_a_new_one_and_completes(tmp_path, tiny_images, monkeypatch):
    """The receiver answers stream_lost for the second segment once (as after a restart): the sender plans
    again and sends the rest as a new stream, and the object arrives whole."""
    from capsule.agentclient import AgentClient

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    version = new_version(a, "cap", 2 << 20, seed=3)
    b = make_store(tmp_path / "b", tiny_images, "tiny")
    agent = Agent(b.home, tmp_path / "b.token")
    streams_seen: list[str] = []
    real = AgentClient.request

    def request(self, method, path, **kw):  # type: ignore[no-untyped-def]
        params = kw.get("params") or {}
        if "stream" in params:
            if params["stream"] not in streams_seen:
                streams_seen.append(params["stream"])
            if len(streams_seen) == 1 and params["seq"] == 1:
                raise ObjectStreamLost("object stream lost (as after a restart)")
        return real(self, method, path, **kw)

    monkeypatch.setattr(AgentClient, "request", request)
    try:
        r = transfer.push(a, version.ref, agent.url, agent.token, transfer.Options(level=19, batch=64))
    finally:
        agent.stop()
    layer = version.chains[0][-1]
    assert has_object(b, "layer", layer) and b.layer_manifest(layer).digest == layer
    assert len(streams_seen) == 2, streams_seen
    obj = next(o for o in r.objects if o.id == layer)
    assert 0 < obj.fetched_bytes <= (2 << 20) - 16 * BLOCK_SIZE  # the first segment's blocks were kept: not sent again
