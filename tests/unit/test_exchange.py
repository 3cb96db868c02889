"""Serving and receiving objects without HTTP (capsule/exchange/): push's receiving side driven
directly on a store (manifest parts, an interrupted receive that resumes, a wrong block refused), and
the leased caches shared by many threads (nothing closed under a user, no file descriptor leaked)."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from capsule.errors import Conflict, InvalidName, NotFound
from capsule.exchange.leases import LeaseCache
from capsule.exchange.receiving import Inbox, decode_manifest_upload, split_blocks_upload
from capsule.exchange.serving import ObjectServer, missing
from capsule.store import Store
from capsule.store.objectio import BlockReader, ReaderCache, has_object
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import ManifestMismatch
from hashcache.hcp import (
    PREFIX_SIZE,
    Expectation,
    ProtocolError,
    compact_records,
    compress_like,
    encode_indices,
    like_records,
    pack_blocks,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _small_hash_cache(monkeypatch):
    monkeypatch.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))


def _fds(under: Path) -> list[str]:
    """This process's open files below ``under`` (a test's own stores): other tests' threads still running in
    the same process (an agent's timers, a scheduler) open and close files of their own meanwhile."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)):
            out.append(target)
    return sorted(out)


def _file_object(store: Store, seed: int, nblocks: int = 300) -> tuple[str, bytes]:
    """A sealed memory image of ``nblocks`` blocks: random ones, zero ones and repeats."""
    rnd = random.Random(seed)
    blocks = []
    for i in range(nblocks):
        if i % 7 == 3:
            blocks.append(bytes(BLOCK_SIZE))
        elif i % 11 == 5 and blocks:
            blocks.append(blocks[0])  # a repeat: travels once
        else:
            blocks.append(rnd.randbytes(BLOCK_SIZE))
    data = b"".join(blocks)
    tmp = store.temp_path(".img")
    tmp.write_bytes(data)
    row = store.seal_file(tmp, "memory")
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
    return row.id, data


@pytest.fixture
def two_stores(tmp_path):
    a, b = Store.open(tmp_path / "a"), Store.open(tmp_path / "b")
    yield a, b
    a.close()
    b.close()


def _parts(store: Store, oid: str, records: int = 64) -> list[bytes]:
    m = store.file_manifest(oid)
    return [Expectation.part_of(m, s, records, PREFIX_SIZE).to_bytes() for s in range(0, max(1, len(m)), records)]


def _begin_all(inbox: Inbox, src: Store, oid: str) -> list[int]:
    parts = _parts(src, oid)
    needed: list[int] = []
    for k, part in enumerate(parts):
        got = inbox.begin("file", oid, part, part=k, parts=len(parts))
        assert got is not None
        needed += got
    return needed


# -- receiving ----------------------------------------------------------------------------------------------

def test_receive_in_parts_then_commit_installs_the_object(two_stores):
    a, b = two_stores
    oid, data = _file_object(a, 1)
    inbox = Inbox(b)
    needed = _begin_all(inbox, a, oid)
    assert len(_parts(a, oid)) > 1
    data_blocks = {i for i in range(300) if i % 7 != 3}
    assert set(needed) < data_blocks  # zero blocks never travel, a repeat travels once
    with BlockReader(a, "file", oid) as reader:
        for k in range(0, len(needed), 50):
            batch = needed[k:k + 50]
            assert inbox.accept("file", oid, batch, reader.read(batch)) == len(batch)
    assert inbox.commit("file", oid, "memory") is True
    assert has_object(b, "file", oid)
    assert b.file_path(oid).read_bytes() == data
    assert inbox.commit("file", oid, "memory") is False  # already here
    assert inbox.begin("file", oid, _parts(a, oid)[0], part=0, parts=len(_parts(a, oid))) is None
    assert not list((b.home / "recv").glob(f"file-{oid}*"))  # nothing left behind
    inbox.close()


def test_interrupted_receive_resumes_with_what_arrived(two_stores):
    a, b = two_stores
    oid, data = _file_object(a, 2)
    inbox = Inbox(b)
    needed = _begin_all(inbox, a, oid)
    first, rest = needed[: len(needed) // 2], needed[len(needed) // 2:]
    with BlockReader(a, "file", oid) as reader:
        inbox.accept("file", oid, first, reader.read(first))
        inbox.close()  # the agent goes away mid-transfer
        again = Inbox(b)
        with pytest.raises(Conflict, match="not complete"):
            again.commit("file", oid)
        resumed = _begin_all(again, a, oid)  # the sender starts over: only what is missing is asked for
        assert resumed and set(resumed) <= set(rest)
        # the rest, less the repeats of blocks that arrived (copied locally as they did)
        assert all(i % 11 == 5 for i in set(rest) - set(resumed))
        again.accept("file", oid, resumed, reader.read(resumed))
    assert again.commit("file", oid) is True
    assert b.file_path(oid).read_bytes() == data
    again.close()


def test_a_wrong_block_is_refused_naming_object_and_block(two_stores):
    a, b = two_stores
    oid, _data = _file_object(a, 3)
    inbox = Inbox(b)
    needed = _begin_all(inbox, a, oid)
    batch = needed[:4]
    with BlockReader(a, "file", oid) as reader:
        blocks = reader.read(batch)
    blocks[2] = bytes(reversed(blocks[2]))
    with pytest.raises(ManifestMismatch) as exc:
        inbox.accept("file", oid, batch, blocks)
    assert oid[:12] in str(exc.value) and f"block {batch[2]}" in str(exc.value)
    # the two blocks before it were right and are kept; the bad one is asked for again
    again = _begin_all(Inbox(b), a, oid)
    assert needed[2] in again and needed[0] not in again and needed[1] not in again
    assert set(again) <= set(needed[2:])
    inbox.close()


def test_receiving_refuses_bad_input(two_stores):
    a, b = two_stores
    oid, _ = _file_object(a, 4)
    inbox = Inbox(b)
    part = _parts(a, oid)[0]
    with pytest.raises(NotFound, match="no transfer"):
        inbox.accept("file", oid, [0], [bytes(BLOCK_SIZE)])
    with pytest.raises(InvalidName):
        inbox.begin("file", "../" + oid[3:], part)
    with pytest.raises(InvalidName):
        inbox.begin("disk", oid, part)
    with pytest.raises(InvalidName, match="part"):
        inbox.begin("file", oid, part, part=3, parts=2)
    with pytest.raises(ProtocolError, match="of a file"):
        inbox.begin("layer", oid, part)
    with pytest.raises(Conflict, match="before the parts before it"):
        inbox.begin("file", oid, part, part=2, parts=5)
    with pytest.raises(ProtocolError, match="truncated"):
        inbox.accept_upload("file", oid, b"\x09\x00\x00\x00abc")
    with pytest.raises(Conflict, match="not every part"):
        inbox.commit("file", oid)
    assert missing(b, [oid], [oid]) == {"layers": [oid], "files": [oid]}
    with pytest.raises(InvalidName):
        missing(b, 5, [])
    inbox.close()


def test_block_upload_as_it_travels(two_stores):
    a, b = two_stores
    oid, data = _file_object(a, 5, nblocks=40)
    inbox = Inbox(b)
    needed = _begin_all(inbox, a, oid)
    with BlockReader(a, "file", oid) as reader:
        idx = encode_indices(needed)
        raw = len(idx).to_bytes(4, "little") + idx + pack_blocks(reader.read(needed))
    assert split_blocks_upload(raw)[0] == idx
    assert inbox.accept_upload("file", oid, raw) == len(needed)
    assert inbox.commit("file", oid)
    assert b.file_path(oid).read_bytes() == data
    inbox.close()


# -- leases -------------------------------------------------------------------------------------------------

class _Thing:
    def __init__(self, key: int) -> None:
        self.key = key
        self.closed = 0


def test_a_leased_entry_is_closed_by_its_last_holder_not_by_eviction():
    closed: list[int] = []

    def close(t: _Thing) -> None:
        t.closed += 1
        closed.append(t.key)

    cache: LeaseCache[int, _Thing] = LeaseCache(_Thing, close, size=1)
    with cache.lease(1) as one:
        with cache.lease(2):  # evicts 1, which is in use
            assert not one.closed
        assert closed == []
        with cache.lease(3):  # evicts 2, idle: closed at once
            assert closed == [2]
        assert not one.closed
    assert one.closed == 1 and closed == [2, 1]
    with cache.lease(3) as three, cache.lease(3) as again:
        assert three is again
        cache.drop(3)
        assert not three.closed
    assert three.closed == 1
    cache.close()
    assert sorted(closed) == [1, 2, 3]


def test_two_threads_missing_at_once_leave_one_entry_and_close_the_other():
    opened: list[_Thing] = []
    barrier = threading.Barrier(2)

    def open_(key: int) -> _Thing:
        barrier.wait(timeout=10)  # both threads are past the miss before either inserts
        t = _Thing(key)
        opened.append(t)
        return t

    cache: LeaseCache[int, _Thing] = LeaseCache(open_, lambda t: setattr(t, "closed", t.closed + 1), size=4)
    got: list[_Thing] = []

    def use() -> None:
        with cache.lease(7) as t:
            got.append(t)

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(opened) == 2 and len(cache) == 1
    assert got[0] is got[1]  # both used the cached one
    assert sorted(t.closed for t in opened) == [0, 1]  # the other was closed, not leaked
    cache.close()
    assert all(t.closed == 1 for t in opened)


# -- many threads through small caches ---------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2])
def test_many_threads_read_through_a_small_reader_cache(tmp_path, size):
    store = Store.open(tmp_path / "s")
    objects = [_file_object(store, 10 + k, nblocks=64) for k in range(5)]
    server = ObjectServer(store, readers=size)
    for oid, _ in objects:
        server.manifest("file", oid)
    before = _fds(tmp_path)
    errors: list[BaseException] = []
    reads = [0]

    def work(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(150):
                oid, data = rnd.choice(objects)
                indices = sorted(rnd.sample(range(64), rnd.randint(1, 6)))
                with server.readers.lease("file", oid) as reader:
                    blocks = reader.read(indices)
                assert blocks == [data[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] for i in indices]
                packed = server.read("file", oid, indices, level=1, compress=False)
                assert packed == pack_blocks(blocks, compress=False)
                reads[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert reads[0] == 12 * 150
    server.close()
    assert _fds(tmp_path) == before  # every reader closed, none leaked
    store.close()


def test_many_threads_receive_through_a_one_entry_receiver_cache(two_stores):
    a, b = two_stores
    objects = [_file_object(a, 20 + k, nblocks=120) for k in range(3)]
    inbox = Inbox(b, cache_size=1)
    plans = {oid: _begin_all(inbox, a, oid) for oid, _ in objects}
    readers = {oid: BlockReader(a, "file", oid) for oid, _ in objects}
    jobs = [(oid, plans[oid][k:k + 3]) for oid in plans for k in range(0, len(plans[oid]), 3)]
    random.Random(1).shuffle(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []
    before = _fds(a.home.parent)

    def work() -> None:
        while True:
            with lock:
                if not jobs:
                    return
                oid, batch = jobs.pop()
            try:
                inbox.accept("file", oid, batch, readers[oid].read(batch))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    inbox.close()
    assert _fds(a.home.parent) == before  # every shadow closed, none leaked
    for oid, data in objects:
        readers[oid].close()
        assert Inbox(b).commit("file", oid)
        assert b.file_path(oid).read_bytes() == data


def test_a_closed_reader_refuses_reads_instead_of_reading_another_file(tmp_path):
    store = Store.open(tmp_path / "s")
    oid, _ = _file_object(store, 30, nblocks=4)
    cache = ReaderCache(store, size=1)
    with cache.lease("file", oid) as reader:
        pass
    reader.close()
    reader.close()  # twice is fine
    with pytest.raises(Conflict, match="closed"):
        reader.read([0])
    cache.close()
    store.close()


def _imports(module: str) -> set[str]:
    """Every project module ``module`` imports, directly or not (lazy imports inside functions too)."""
    import ast
    import importlib.util

    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for dep in found:
                if dep.split(".")[0] in ("capsule", "hashcache", "diskserver", "fastapi", "starlette", "uvicorn"):
                    todo.append(dep)
    return seen


@pytest.mark.parametrize("module", ["capsule.exchange.receiving", "capsule.exchange.serving", "capsule.transfer"])
def test_the_library_and_the_client_do_not_import_the_agent(module):
    server = ("capsule.agent", "fastapi", "starlette", "uvicorn")
    bad = sorted(m for m in _imports(module) if any(m == s or m.startswith(s + ".") for s in server))
    assert bad == []


def test_a_begin_under_another_manifest_size_starts_the_receive_over(two_stores):
    """A receive begun (and partly filled) under a manifest of another size for this id — a sender that
    lied, or a stale one — does not stand in the way of the object's real push: the new transfer's first
    part throws the old shadow away. Nothing half-received is installed."""
    a, b = two_stores
    oid, data = _file_object(a, 5, nblocks=300)
    other, _ = _file_object(a, 6, nblocks=100)
    inbox = Inbox(b)
    bogus = _parts(a, other)
    got = inbox.begin("file", oid, bogus[0], part=0, parts=len(bogus))
    assert got
    with BlockReader(a, "file", other) as reader:
        inbox.accept("file", oid, got[:3], reader.read(got[:3]))
    assert not has_object(b, "file", oid)
    needed = _begin_all(inbox, a, oid)           # the real one: no shadow error, every data block asked for
    c = Store.open(b.home.parent / "c")
    fresh = Inbox(c)
    assert needed == _begin_all(fresh, a, oid)
    fresh.close()
    c.close()
    with BlockReader(a, "file", oid) as reader:
        inbox.accept("file", oid, needed, reader.read(needed))
    assert inbox.commit("file", oid) is True
    assert b.file_path(oid).read_bytes() == data
    inbox.close()


def test_a_manifest_part_is_bounded_by_records_and_its_upload_by_bytes(two_stores, tmp_path):
    """A part holds at most MAX_PART_RECORDS records (what a push sends); the agent refuses a bigger upload
    (413) from its declared length, before reading it, and over the limit while it streams."""
    import zstandard
    from fastapi.testclient import TestClient

    from capsule.agent.app import create_app
    from capsule.exchange.receiving import MAX_MANIFEST_UPLOAD
    from hashcache.hcp import MAX_PART_RECORDS
    from hashcache.manifest import Manifest

    a, b = two_stores
    oid, _ = _file_object(a, 7, nblocks=2 * MAX_PART_RECORDS)   # a seventh of the blocks are zero: no record
    m = a.file_manifest(oid)
    assert isinstance(m, Manifest) and len(m) > MAX_PART_RECORDS
    whole = Expectation.part_of(m, 0, len(m), PREFIX_SIZE).to_bytes()
    inbox = Inbox(b)
    with pytest.raises(ProtocolError, match=f"at most {MAX_PART_RECORDS} records"):
        inbox.begin("file", oid, whole)
    inbox.close()
    assert not list((b.home / "recv").glob("*"))
    token = "t" * 32
    client = TestClient(create_app(b.home, token), raise_server_exceptions=False)
    url = f"/v1/recv/file/{oid}/begin"
    headers = {"Authorization": f"Bearer {token}"}
    big = bytes(MAX_MANIFEST_UPLOAD + 1)
    r = client.post(url, content=big, headers=headers)
    assert r.status_code == 413 and "over" in r.text
    r = client.post(url, content=iter([big[:1 << 16]] * (len(big) // (1 << 16) + 1)), headers=headers)
    assert r.status_code == 413          # streamed without a length: refused once over the limit
    r = client.post(url, content=zstandard.ZstdCompressor().compress(whole), headers=headers)
    assert r.status_code == 400 and "records" in r.text
    part = Expectation.part_of(m, 0, MAX_PART_RECORDS, PREFIX_SIZE).to_bytes()
    r = client.post(url + "?part=0&parts=2", content=zstandard.ZstdCompressor().compress(part), headers=headers)
    assert r.status_code == 200


def test_a_part_compressed_against_a_like_is_read_against_the_same_records_here(two_stores):
    a, b = two_stores
    like, _ = _file_object(a, 5)
    like_b, _ = _file_object(b, 5)                       # b holds the same image: the same id
    assert like_b == like
    oid, _ = _file_object(a, 6)                          # another image (other random blocks at some places)
    m = a.file_manifest(oid)
    part = Expectation.part_of(m, 40, 100, PREFIX_SIZE)
    first, last = part.keys[0] >> 1, part.keys[-1] >> 1
    records = like_records(a.file_manifest(like), first, last, PREFIX_SIZE)
    assert records == compact_records(a.file_manifest(like), *a.file_manifest(like).records_between(first, last))
    inbox = Inbox(b)
    assert inbox.like(like, first, last, PREFIX_SIZE) == records          # both ends make it the same
    body = compress_like(part.to_bytes(), records)
    assert decode_manifest_upload(body, inbox.like(like, first, last, PREFIX_SIZE)) == part.to_bytes()
    # a like not held here, one of a bad id, a bad span or hash length: refused before anything is read
    with pytest.raises(Conflict, match="not held here"):
        inbox.like(oid, first, last, PREFIX_SIZE)
    for args in [("../x", 0, 1, 8), (like, 5, 4, 8), (like, 0, 1, 16), (like, -1, 1, 8), (like, 0, 1 << 60, 8)]:
        with pytest.raises(InvalidName):
            inbox.like(*args)
    inbox.close()


def test_records_between_is_the_records_of_those_blocks():
    from hashcache.manifest import Manifest

    indices = [0, 3, 4, 9, 200]
    rec = b"".join((i << 1).to_bytes(8, "little") + bytes([i + 1]) * 32 for i in indices)
    m = Manifest("file", "blake3", 4096, 201 * 4096, None, rec)
    assert m.records_between(0, 200) == (0, 5)
    assert m.records_between(1, 8) == (1, 2)        # blocks 3 and 4
    assert m.records_between(5, 8) == (3, 0)
    assert m.records_between(9, 9) == (3, 1)
    assert m.records_between(201, 300) == (5, 0)


def test_a_like_a_grant_may_not_read_is_refused_as_not_held(two_stores, monkeypatch):
    from capsule.exchange import holdings

    a, b = two_stores
    like, _ = _file_object(b, 5)
    grant = object()                                   # a grant whose objects are some other capsule's
    monkeypatch.setattr(holdings.grants, "readable", lambda store, g: (frozenset(), frozenset({"f" * 64})))
    inbox = Inbox(b)
    with pytest.raises(Conflict, match="not held here"):
        inbox.like(like, 0, 10, PREFIX_SIZE, grant)    # type: ignore[arg-type]
    monkeypatch.setattr(holdings.grants, "readable", lambda store, g: (frozenset(), frozenset({like})))
    assert inbox.like(like, 0, 10, PREFIX_SIZE, grant)  # type: ignore[arg-type]
    inbox.close()


def test_read_hash_against_a_like_both_hold_and_plain_where_the_caller_may_not_read_it(two_stores, monkeypatch):
    from capsule.exchange import holdings
    from capsule.transfer.manifestparts import span_dictionary

    a, b = two_stores
    like, _ = _file_object(a, 5)
    _file_object(b, 5)
    oid, _ = _file_object(a, 6)
    server = ObjectServer(a)
    plain, n, span = server.records("file", oid, 10, 100, PREFIX_SIZE)
    assert span is None
    liked, n2, span = server.records("file", oid, 10, 100, PREFIX_SIZE, like)
    assert n2 == n == 100 and span is not None
    here = span_dictionary(b.file_manifest(like), span, PREFIX_SIZE, 300)          # the caller's side
    from hashcache.hcp import decompress_bounded

    assert decompress_bounded(liked, 100 * 16, dictionary=here) == decompress_bounded(plain, 100 * 16)
    # a like the caller's grant may not read, or one not held here: plain, and nothing said of it
    monkeypatch.setattr(holdings.grants, "readable", lambda store, g: (frozenset(), frozenset()))
    assert server.records("file", oid, 10, 100, PREFIX_SIZE, like, object())[2] is None   # type: ignore[arg-type]
    assert server.records("file", oid, 10, 100, PREFIX_SIZE, "e" * 64)[2] is None
    with pytest.raises(InvalidName):
        server.records("file", oid, 10, 100, PREFIX_SIZE, "../x")
    # a peer's span is checked before it sizes anything
    for bad in ("5", "9-5", "0-300", "-1-4", "a-b", "1-2-3"):
        with pytest.raises(ProtocolError):
            span_dictionary(b.file_manifest(like), bad, PREFIX_SIZE, 300)
    server.close()


@pytest.mark.parametrize("features, liked", [(frozenset(), False), (frozenset({"manifest-like"}), True)])
def test_manifest_parts_go_against_a_like_only_to_a_receiver_that_names_it(two_stores, features, liked):
    from types import SimpleNamespace

    from capsule.transfer.manifestparts import PartSender

    a, _b = two_stores
    like, _ = _file_object(a, 5)
    oid, _ = _file_object(a, 6)
    sent: list[dict] = []
    client = SimpleNamespace(features=features,
                             request=lambda method, path, **kw: sent.append(kw["params"]) or SimpleNamespace())
    parts = PartSender(a, client, "file", oid, PREFIX_SIZE, like=like)   # type: ignore[arg-type]
    parts.begin(Expectation.part_of(a.file_manifest(oid), 0, 100, PREFIX_SIZE), 0, 1)
    assert ("like" in sent[0]) is liked and parts.liked == int(liked)
    assert sent[0]["part"] == 0 and sent[0]["parts"] == 1
