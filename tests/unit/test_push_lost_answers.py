"""A push whose block uploads lose their answers (the receiving agent killed and started again, a broken
link) sends again only the blocks the receiver has not kept (capsule/transfer/resend.py), through the
agent's real HTTP handling (``create_app``, in-process): before, each such batch went again whole."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from capsule import transfer
from capsule.agentclient import AgentClient
from capsule.errors import Unreachable
from capsule.store import Store
from capsule.store.objectio import has_object
from capsule.transfer import pushpull
from hashcache.hcp import decode_indices
from hashcache.transport import RetryPolicy
from hashcache.transport.memory import in_process
from tests.helpers.transport_fixtures import TOKEN, agent_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BLOCKS = 64
BATCH = 8   # blocks per batch asked for (the pacer may make them larger)


class _LoseAnswers:
    """A transport wrapper: the block uploads numbered in ``lose`` reach the agent, which keeps them, but
    their answers are lost (Unreachable, as when the agent dies before answering), or with ``before`` they
    are lost on the way; counts the blocks of every upload. ``old``: the agent does not know the
    ``lacking`` call (an older release)."""

    def __init__(self, inner, lose: set[int], old: bool = False, before: bool = False) -> None:
        self.inner, self.url, self.lose, self.old, self.before = inner, inner.url, lose, old, before
        self.uploads = 0
        self.blocks_sent = 0
        self.sizes: list[int] = []   # blocks of each upload, in order
        self.lock = threading.Lock()

    def call(self, call):
        if call.path.endswith("/lacking") and self.old:
            call = replace(call, path=call.path.replace("/lacking", "/not-a-route"))
        if not call.path.endswith("/blocks"):
            return self.inner.call(call)
        n = int.from_bytes(call.content[:4], "little")
        with self.lock:
            self.uploads += 1
            number = self.uploads
            self.sizes.append(len(decode_indices(call.content[4:4 + n], 1 << 30)))
            self.blocks_sent += self.sizes[-1]
        if number in self.lose and self.before:   # lost on the way: the agent never saw it
            raise Unreachable("Connection reset by peer")
        reply = self.inner.call(call)
        if number in self.lose:
            raise Unreachable("Server disconnected without sending a response")
        return reply

    def close(self):
        self.inner.close()


def _source(tmp_path) -> tuple[Store, str]:
    src = Store.open(tmp_path / "src")
    path = src.temp_path("-obj")
    path.write_bytes(b"".join((i + 5000).to_bytes(4, "little") * 1024 for i in range(BLOCKS)))  # none the agent holds
    row = src.seal_file(path, "kernel")
    with src.catalogue.transaction():
        src.catalogue.add_file(row)
    return src, row.id


def _push(tmp_path, lose: set[int], old: bool = False, before: bool = False) -> _LoseAnswers:
    src, fid = _source(tmp_path)
    with agent_app(tmp_path / "dst") as dst:
        wrapper = _LoseAnswers(in_process(dst.app, TOKEN, stream=False), lose, old, before)
        client = AgentClient("http://dst.example", TOKEN, transport=wrapper, retry=RetryPolicy(delays=(0.01,) * 3))
        opts = transfer.Options(batch=BATCH, inflight=2)
        report = pushpull._push_object(src, client, "file", fid, "kernel", opts, transfer.Progress())
        client.close()
        assert report is not None and report.fetched_bytes == BLOCKS * 4096
        dst_store = Store.open(tmp_path / "dst")
        assert has_object(dst_store, "file", fid)
        dst_store.close()
    src.close()
    return wrapper


@pytest.mark.parametrize("lose", [{1}, {2, 3}, set(range(1, 20))], ids=["one", "two", "all"])
def test_blocks_kept_by_the_receiver_are_not_sent_again_after_a_lost_answer(tmp_path, lose):
    """Old code: each upload whose answer was lost was sent again whole (BATCH blocks more each)."""
    wrapper = _push(tmp_path, lose)
    assert wrapper.blocks_sent == BLOCKS, wrapper.sizes


def test_a_receiver_without_the_lacking_call_gets_the_whole_batch_again(tmp_path):
    wrapper = _push(tmp_path, {2}, old=True)
    assert wrapper.blocks_sent == BLOCKS + wrapper.sizes[1], wrapper.sizes


def test_a_batch_lost_on_the_way_is_sent_again_whole(tmp_path):
    wrapper = _push(tmp_path, {3}, before=True)
    assert wrapper.blocks_sent == BLOCKS + wrapper.sizes[2], wrapper.sizes


def test_the_lacking_call_refuses_bad_input_and_names_what_is_not_kept(tmp_path):
    from starlette.testclient import TestClient

    from capsule.exchange.receiving import MAX_LACKING_UPLOAD
    from hashcache.hcp import encode_indices

    with agent_app(tmp_path / "dst") as dst:
        http = TestClient(dst.app)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        url = f"/v1/recv/file/{'a' * 64}/lacking"
        r = http.post(url, content=encode_indices([0, 1]), headers=auth)
        assert r.status_code == 404 and "no transfer" in r.json()["detail"], r.text
        r = http.post(url, content=b"\x00" * (MAX_LACKING_UPLOAD + 1), headers=auth)
        assert r.status_code == 413, r.text
        r = http.post(f"/v1/recv/file/{dst.file_id}/lacking", content=encode_indices([0, 1]), headers=auth)
        assert r.status_code == 200 and r.content == b"", r.text   # installed: it lacks none


class _LoseBeginAnswers:
    """A transport wrapper: the manifest parts (``begin``) numbered in ``lose`` reach the agent, which takes
    them, but their answers are lost."""

    def __init__(self, inner, lose: set[int]) -> None:
        self.inner, self.url, self.lose = inner, inner.url, lose
        self.begins = 0

    def call(self, call):
        if not call.path.endswith("/begin"):
            return self.inner.call(call)
        self.begins += 1
        reply = self.inner.call(call)
        if self.begins in self.lose:
            raise Unreachable("Connection reset by peer")
        return reply

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("lose", [{1}, {2}, {4}, {2, 4}], ids=["first", "middle", "last", "middle-and-last"])
def test_a_manifest_part_whose_answer_was_lost_is_sent_again_and_taken(tmp_path, monkeypatch, lose):
    """Old code: begin was not retried, and a part sent twice was refused ('arrived before the parts before
    it'): a reset during the upload of a manifest's second part failed the push (bench.faults, 64 MiB)."""
    monkeypatch.setattr(pushpull, "PART_RECORDS", BLOCKS // 4)   # four parts of 16 records
    src, fid = _source(tmp_path)
    with agent_app(tmp_path / "dst") as dst:
        wrapper = _LoseBeginAnswers(in_process(dst.app, TOKEN, stream=False), lose)
        client = AgentClient("http://dst.example", TOKEN, transport=wrapper, retry=RetryPolicy(delays=(0.01,) * 3))
        report = pushpull._push_object(src, client, "file", fid, "kernel", transfer.Options(batch=BATCH, inflight=2),
                                       transfer.Progress())
        client.close()
        assert report is not None and report.fetched_bytes == BLOCKS * 4096
        assert wrapper.begins == 4 + len(lose)
    dst_store = Store.open(tmp_path / "dst")
    assert has_object(dst_store, "file", fid)
    dst_store.close()
    src.close()



def test_a_different_part_under_a_number_already_taken_is_refused(tmp_path):
    """Taking a part again is for the very same records only: other records under that number are a 409."""
    import zstandard
    from starlette.testclient import TestClient

    from capsule.store.objectio import object_manifest
    from hashcache.hcp import Expectation

    src, fid = _source(tmp_path)
    manifest = object_manifest(src, "file", fid)
    part = [Expectation.part_of(manifest, start, BLOCKS // 4, 32).to_bytes() for start in range(0, BLOCKS, BLOCKS // 4)]
    src.close()
    with agent_app(tmp_path / "dst") as dst:
        http = TestClient(dst.app)
        auth = {"Authorization": f"Bearer {TOKEN}"}

        def begin(k: int, raw: bytes):
            return http.post(f"/v1/recv/file/{fid}/begin", content=zstandard.ZstdCompressor().compress(raw),
                             params={"part": k, "parts": 4}, headers=auth)

        assert begin(0, part[0]).status_code == 200
        assert begin(1, part[1]).status_code == 200
        assert begin(1, part[1]).status_code == 200            # the same part again: taken
        r = begin(1, part[2])                                   # other records under number 1
        assert r.status_code == 409 and "arrived before" in r.json()["detail"], r.text
