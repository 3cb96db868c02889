"""A push changes codec in the middle of an object when the pick changes (capsule/transfer/pushing.py):
from an xz object stream to zstd -3 frames and on to a new zstd -19 stream, through the agent's real HTTP
handling (``create_app``, in-process). The segments of the stream it leaves are all taken before the new
one starts there, and the object arrives whole. Before, an object stream, once started, lasted to the
object's end whatever the link did."""

from __future__ import annotations

import random
import threading

import pytest

from capsule import transfer
from capsule.agentclient import AgentClient
from capsule.store import Store
from capsule.store.objectio import has_object
from capsule.transfer import codecpick, pushing
from capsule.transfer.codecpick import XZ, ZSTD3, Codec
from tests.helpers.transport_fixtures import TOKEN, agent_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BLOCKS = 320
Z19 = Codec("zstd", 19)
PLAN = [XZ] * 4 + [ZSTD3] * 4 + [Z19] * 100   # the picks, batch by batch


class _Uploads:
    """A transport wrapper that notes each block upload's stream, its place in it and its codec."""

    def __init__(self, inner) -> None:
        self.inner, self.url = inner, inner.url
        self.seen: list[tuple[str, int, str]] = []     # (stream id or "", seq, codec or "frame")
        self.lock = threading.Lock()

    def call(self, call):
        if call.path.endswith("/blocks"):
            p = call.params or {}
            with self.lock:
                self.seen.append((str(p.get("stream", "")), int(p.get("seq", -1)), str(p.get("codec", "frame"))))
        return self.inner.call(call)

    def close(self):
        self.inner.close()


def test_a_push_leaves_a_stream_for_frames_and_a_new_stream_when_the_pick_changes(tmp_path, monkeypatch):
    from hashcache.transport.memory import in_process

    picks = iter(PLAN)

    def scripted(self, allowed, keep=None):
        pick = next(picks)
        assert pick in allowed
        return pick

    monkeypatch.setattr(codecpick.CodecPicker, "choose", scripted)
    src = Store.open(tmp_path / "src")
    path = src.temp_path("-obj")
    rng = random.Random(5)
    path.write_bytes(b"".join(rng.randbytes(512) * 8 for _ in range(BLOCKS)))   # compressible, none alike
    row = src.seal_file(path, "kernel")
    with src.catalogue.transaction():
        src.catalogue.add_file(row)
    with agent_app(tmp_path / "dst") as dst:
        wrapper = _Uploads(in_process(dst.app, TOKEN, stream=False))
        client = AgentClient("http://dst.example", TOKEN, transport=wrapper)
        report = pushing._push_object(src, client, "file", row.id, "kernel",
                                      transfer.Options(batch=8, inflight=2), transfer.Progress())
        client.close()
    assert report is not None and report.fetched_bytes == BLOCKS * 4096
    assert set(report.codecs) == {"xz", "zstd-3", "zstd-19"}, report.codecs
    streams = [(sid, seq, codec) for sid, seq, codec in wrapper.seen if sid]
    ids = list(dict.fromkeys(sid for sid, _seq, _codec in streams))
    assert len(ids) == 2, wrapper.seen                                 # xz, then a new zstd -19 stream
    for sid, codec in zip(ids, ("xz", "zstd"), strict=True):
        seqs = [seq for s, seq, c in streams if s == sid]
        assert seqs == list(range(len(seqs))) and {c for s, _q, c in streams if s == sid} == {codec}
    assert any(codec == "frame" for _s, _q, codec in wrapper.seen)     # zstd -3 frames between them
    dst_store = Store.open(tmp_path / "dst")
    assert has_object(dst_store, "file", row.id)                       # verified against its digest
    dst_store.close()
    src.close()
