"""The capsule repository's format and keys, in process (an in-memory bucket stands in for the object store;
the real one is tests/tools/test_repo_seaweedfs.py): sealing round trips, keyed block ids, packs and indexes
parsed from hostile bytes, a tampered or moved object refused, wrong passphrases refused, keys added and
removed, repository URLs."""

from __future__ import annotations

import contextlib
import random
import struct

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.errors import AlreadyExists, AuthFailed, Conflict, IntegrityError, InvalidName, NotFound
from capsule.repo import crypto
from capsule.repo.format import (
    NO_ID,
    PACK2_MAGIC,
    SINGLE,
    Entry,
    PackWriter,
    Place,
    Range,
    blobs_of,
    decode_index,
    encode_index,
    open_blob,
    open_range,
    read_pack_header,
)
from capsule.repo.repository import Repository
from capsule.repo.s3 import Location, parse_url
from hashcache.blocks import hash_block

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

FAST_N = 2**10     # scrypt's cost in these tests (the default is 2**15)
_KEY = crypto.MasterKey.new()


class MemoryBucket:
    """The S3Client calls a Repository makes, on a dict."""

    def __init__(self, prefix: str = "repo") -> None:
        self.location = Location("http://127.0.0.1:1", "bucket", prefix)
        self.objects: dict[str, bytes] = {}
        self.sent_bytes = 0

    def put(self, key, data):
        self.objects[key] = bytes(data)
        self.sent_bytes += len(data)

    def get(self, key, start=None, length=None):
        if key not in self.objects:
            raise NotFound(key)
        data = self.objects[key]
        return data if start is None else data[start:None if length is None else start + length]

    def head(self, key):
        return len(self.objects[key]) if key in self.objects else None

    def delete(self, key):
        self.objects.pop(key, None)

    def list(self, prefix):
        return iter(sorted((k, len(v)) for k, v in self.objects.items() if k.startswith(prefix)))

    def bucket_exists(self):
        return True

    def create_bucket(self):
        pass


@pytest.fixture
def bucket():
    return MemoryBucket()


def _init(bucket, secret=b"pass one"):
    return Repository.init(bucket, secret, scrypt_n=FAST_N)


def test_seal_round_trip_and_tampering_refused():
    key = crypto.MasterKey.new()
    sealed = key.seal(b"version record", "versions/abc")
    assert key.open(sealed, "versions/abc", "it") == b"version record"
    assert b"version record" not in sealed
    flipped = bytearray(sealed)
    flipped[-3] ^= 1
    with pytest.raises(IntegrityError, match="tampered"):
        key.open(bytes(flipped), "versions/abc", "record abc")
    with pytest.raises(IntegrityError, match="tampered"):      # copied over another object's name
        key.open(sealed, "versions/abd", "record abd")
    with pytest.raises(IntegrityError, match="tampered"):      # another repository's key
        crypto.MasterKey.new().open(sealed, "versions/abc", "record abc")
    with pytest.raises(IntegrityError, match="truncated"):
        key.open(sealed[:10], "versions/abc", "record abc")


def test_block_ids_are_keyed():
    h = hash_block(b"a known file's block".ljust(4096, b"\0"))
    k1, k2 = crypto.MasterKey.new(), crypto.MasterKey.new()
    assert k1.block_id(h) == k1.block_id(h) != k2.block_id(h)
    assert h not in k1.block_id(h) and len(k1.block_id(h)) == 32
    assert k1.object_name("layer", h.hex()) != k2.object_name("layer", h.hex())


def test_pack_round_trip_and_a_flipped_byte_is_refused():
    key = crypto.MasterKey.new()
    rng = random.Random(3)
    blocks = {key.block_id(bytes([i]) * 32): rng.randbytes(4096) if i % 2 else bytes([i]) * 4096 for i in range(20)}
    writer = PackWriter(key)
    for bid, data in blocks.items():
        writer.add(bid, data)
    body = writer.finish()
    header = read_pack_header(key, writer.id, body)
    assert header == writer.entries
    assert not body.endswith(PACK2_MAGIC)           # single blobs only: a pack format 1 reads
    for bid, (off, n, slot) in header.items():
        assert slot == SINGLE and open_blob(key, bid, body[off:off + n], "blob", 4096) == blocks[bid]
    assert not any(data in body for data in blocks.values() if len(set(data)) > 1)   # no block in clear
    bid, (off, n, _slot) = next(iter(header.items()))
    flipped = bytearray(body[off:off + n])
    flipped[n // 2] ^= 0x40
    with pytest.raises(IntegrityError, match="tampered"):
        open_blob(key, bid, bytes(flipped), f"a block in pack {writer.id}", 4096)
    other = next(b for b in header if b != bid)
    with pytest.raises(IntegrityError):                          # a blob moved under another block's id
        open_blob(key, other, body[off:off + n], "blob", 4096)
    with pytest.raises(IntegrityError):
        read_pack_header(key, writer.id, body[:-5] + b"\0" + body[-4:])


def test_index_round_trip():
    entries = {"ab" * 16: {bytes([i]) * 32: Place(i * 100, 90) for i in range(5)},
               "cd" * 16: {b"\xff" * 32: Place(0, 50)}}
    encoded = encode_index(entries)
    index = decode_index(encoded, "index x")
    assert len(index) == 6 and index[b"\xff" * 32].pack == "cd" * 16 and index[bytes([3]) * 32].offset == 300
    assert zstandard.ZstdDecompressor().decompress(encoded).startswith(b"CIX1")   # format 1 where it can be


def _group_pack(key, count=40, group=16):
    rng = random.Random(5)
    blocks = [rng.randbytes(2048) * 2 if i % 3 else bytes([i]) * 4096 for i in range(count)]
    ids = [key.block_id(hash_block(b)) for b in blocks]
    writer = PackWriter(key)
    writer.add(key.block_id(hash_block(b"s" * 4096)), b"s" * 4096)       # a format-1 blob beside groups
    for start in range(0, count, group):
        writer.add_group(list(zip(ids[start:start + group], blocks[start:start + group], strict=True)))
    return writer, writer.finish(), dict(zip(ids, blocks, strict=True))


def test_a_pack_of_groups_round_trips_and_each_block_is_checked_against_its_id():
    key = crypto.MasterKey.new()
    writer, body, blocks = _group_pack(key)
    assert body.endswith(PACK2_MAGIC)
    header = read_pack_header(key, writer.id, body)
    assert header == writer.entries and len(header) == 41
    assert sorted({p.slot for p in header.values()}) == [SINGLE, *range(16)]
    assert len({(p.offset, p.length) for p in header.values()}) == 4      # 16 + 16 + 8 blocks and the single
    items = tuple((bid, Entry(writer.id, *p)) for bid, p in header.items())
    opened: dict[int, bytes] = {}
    got = open_range(key, Range(writer.id, 0, len(body), items), body, "pack", opened)
    assert {bid: got[bid] for bid in blocks} == blocks and len(opened) == 3
    # sixteen blocks compressed together take less than sixteen compressed one by one
    single = PackWriter(key)
    for bid, data in blocks.items():
        single.add(bid, data)
    assert len(body) < len(single.finish())
    # a blob's slot pointed at another block (a moved blob, or an index that lies) is caught
    bid, place = next((b, p) for b, p in header.items() if p.slot == 3)
    with pytest.raises(IntegrityError, match="not the one its id names"):
        open_range(key, Range(writer.id, 0, len(body), ((bid, Entry(writer.id, place.offset, place.length, 4)),)),
                   body, "pack")
    flipped = bytearray(body)
    flipped[place.offset + place.length // 2] ^= 1
    with pytest.raises(IntegrityError, match="tampered"):
        open_range(key, Range(writer.id, 0, len(body), ((bid, Entry(writer.id, *place)),)), bytes(flipped), "pack")


def test_index_of_groups_with_a_hole_and_a_copied_format_1_blob():
    key = crypto.MasterKey.new()
    writer, body, blocks = _group_pack(key)
    places = dict(writer.entries)
    gone = next(b for b, p in places.items() if p.slot == 2)
    del places[gone]                                    # listed in another pack by a later index
    encoded = encode_index({writer.id: places, "cd" * 16: {b"\x01" * 32: Place(0, 77)}})
    raw = zstandard.ZstdDecompressor().decompress(encoded)
    assert raw.startswith(b"CIX2") and NO_ID in raw
    index = decode_index(encoded, "index x")
    assert gone not in index and len(index) == 41
    assert {b: e.place for b, e in index.items() if e.pack == writer.id} == places
    assert index[b"\x01" * 32] == Entry("cd" * 16, 0, 77, SINGLE)
    copy = PackWriter(key)                              # prune's repacking: blobs moved unopened
    for (off, n), members in blobs_of(writer.entries).items():
        copy.add_sealed(members, body[off:off + n])
    moved = copy.finish()
    header = read_pack_header(key, copy.id, moved)
    items = tuple((b, Entry(copy.id, *p)) for b, p in header.items())
    got = open_range(key, Range(copy.id, 0, len(moved), items), moved, "pack")
    assert {b: got[b] for b in blocks} == blocks


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_hostile_index_bytes_raise_integrity_errors_only(data):
    for candidate in (data, zstandard.ZstdCompressor().compress(data),
                      zstandard.ZstdCompressor().compress(b"CIX1" + data),
                      zstandard.ZstdCompressor().compress(b"CIX2" + data)):
        with contextlib.suppress(IntegrityError):
            decode_index(candidate, "index x")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=2**32 - 1))
def test_hostile_pack_bytes_raise_integrity_errors_only(data, hlen):
    key = crypto.MasterKey.new()
    for candidate in (data, data + struct.pack("<I", hlen), data + struct.pack("<I", min(hlen, len(data))),
                      data + struct.pack("<I", min(hlen, len(data))) + PACK2_MAGIC):
        with pytest.raises(IntegrityError):
            read_pack_header(key, "ab" * 16, candidate)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_hostile_format_2_headers_sealed_with_the_key_raise_integrity_errors_only(data):
    """What a key holder gone wrong could write: a sealed header of any bytes after the CPH2 magic."""
    key = _KEY
    sealed = key.seal(b"CPH2" + data, "pack-header/" + "ab" * 16)
    body = bytes(1000) + sealed + struct.pack("<I", len(sealed)) + PACK2_MAGIC
    with contextlib.suppress(IntegrityError):
        for place in read_pack_header(key, "ab" * 16, body).values():
            assert place.offset + place.length <= 1000 and -1 <= place.slot < 64


def test_init_open_and_wrong_passphrase(bucket):
    repo = _init(bucket)
    assert Repository.open(bucket, b"pass one").config["id"] == repo.config["id"]
    with pytest.raises(AuthFailed, match="wrong passphrase"):
        Repository.open(bucket, b"pass two")
    with pytest.raises(AlreadyExists):
        _init(bucket)
    with pytest.raises(NotFound, match="repo init"):
        Repository.open(MemoryBucket(), b"pass one")


def test_a_tampered_config_or_key_is_refused(bucket):
    _init(bucket)
    config = bucket.objects["repo/config"]
    bucket.objects["repo/config"] = config[:-1] + bytes([config[-1] ^ 1])
    with pytest.raises(IntegrityError, match="config failed authentication"):
        Repository.open(bucket, b"pass one")
    bucket.objects["repo/config"] = config
    key_name = next(k for k in bucket.objects if k.startswith("repo/keys/"))
    bucket.objects[key_name] = b"{not json"
    with pytest.raises(IntegrityError, match="malformed"):
        Repository.open(bucket, b"pass one")


def test_keys_add_ls_rm(bucket):
    repo = _init(bucket)
    second = repo.add_key(b"pass two")
    assert {k["id"] for k in repo.list_keys()} == {repo.key_id, second}
    opened = Repository.open(bucket, b"pass two")
    assert opened.key_id == second and opened.key == repo.key
    with pytest.raises(Conflict, match="opened the repository with"):
        opened.remove_key(second)
    with pytest.raises(NotFound):
        opened.remove_key("00" * 16)
    opened.remove_key(repo.key_id)
    with pytest.raises(AuthFailed):
        Repository.open(bucket, b"pass one")
    assert [k["id"] for k in opened.list_keys()] == [second]
    assert not any(b"pass" in body for body in bucket.objects.values())


def test_a_tampered_index_is_refused(bucket):
    repo = _init(bucket)
    writer = PackWriter(repo.key)
    writer.add(repo.key.block_id(b"h" * 32), b"x" * 4096)
    repo.put_sealed("index/" + "ab" * 16, encode_index({writer.id: writer.entries}))
    assert len(repo.load_index()[0]) == 1
    body = bucket.objects["repo/index/" + "ab" * 16]
    bucket.objects["repo/index/" + "ab" * 16] = body[:20] + bytes([body[20] ^ 1]) + body[21:]
    with pytest.raises(IntegrityError, match="index index/abab.* failed authentication"):
        repo.load_index()


def test_lock_shared_and_exclusive(bucket):
    repo = _init(bucket)
    with repo.lock(), repo.lock(), pytest.raises(Conflict, match="locked by"), repo.lock(exclusive=True):
        pass
    with repo.lock(exclusive=True), pytest.raises(Conflict, match="prune"), repo.lock():
        pass
    assert not any(k.startswith("repo/locks/") for k in bucket.objects)


@pytest.mark.parametrize(("url", "endpoint", "bucket", "prefix"), [
    ("s3://store.example:8333/backups/lab/a", "https://store.example:8333", "backups", "lab/a"),
    ("s3+http://127.0.0.1:9000/b-1", "http://127.0.0.1:9000", "b-1", ""),
])
def test_repository_urls(url, endpoint, bucket, prefix):
    loc = parse_url(url)
    assert (loc.endpoint, loc.bucket, loc.prefix) == (endpoint, bucket, prefix)
    assert parse_url(loc.url) == loc


@pytest.mark.parametrize("url", ["http://h/b", "s3://h", "s3:///bucket", "s3://h/UPPER", "s3://h/b/../x",
                                 "s3://h/b?x=1", "s3://h/ab"])
def test_bad_repository_urls_are_refused(url):
    with pytest.raises(InvalidName):
        parse_url(url)


def test_a_long_push_keeps_its_lock_fresh(bucket, monkeypatch):
    """Each pack a push uploads refreshes its lock once it is due, so prune never takes a running push's lock
    for a dead writer's."""
    from capsule.repo import push as push_mod
    from capsule.repo import repository

    repo = _init(bucket)
    monkeypatch.setattr(Repository, "pack_size", property(lambda self: 8192))
    monkeypatch.setattr(Repository, "blob_blocks", property(lambda self: 2))     # a pack: two random blocks
    writes = []
    with repo.lock() as lock, push_mod.Uploads(bucket) as uploads:
        real_put = bucket.put
        monkeypatch.setattr(bucket, "put", lambda key, data: (writes.append(key), real_put(key, data)))
        monkeypatch.setattr(repository, "REFRESH_LOCK_SECONDS", 0.0)
        report = push_mod.PushReport("x@1", "url")
        session = push_mod._Session(repo, set(), report, lambda _m: None, lock, uploads)
        for i in range(6):
            session.add(bytes([i]) * 32, random.Random(i).randbytes(4096))
        session.flush()
        uploads.wait()
    assert report.packs == 3 and sum(1 for k in writes if k == f"repo/{lock.name}") == 3
    assert sum(1 for k in writes if "/packs/" in k) == 3


def test_credentials_never_show_their_secret():
    from capsule.repo.s3 import Credentials

    shown = repr(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI-secret", "session-token"))
    assert "AKIDEXAMPLE" in shown and "secret" not in shown and "session-token" not in shown


def test_a_format_1_repository_is_upgraded_in_place_and_a_newer_format_is_refused(bucket):
    repo = Repository.init(bucket, b"pass one", scrypt_n=FAST_N, fmt=1)
    assert repo.blob_blocks == 1 and "blob_blocks" not in repo.config
    # a push at work: the upgrade waits for it, as prune does
    with repo.lock(), pytest.raises(Conflict, match="locked"):
        Repository.open(bucket, b"pass one").upgrade()
    assert Repository.open(bucket, b"pass one").config["format"] == 1
    done = repo.upgrade()
    assert done["upgraded"] and done["from"] == 1 and done["format"] == 2
    again = Repository.open(bucket, b"pass one")
    assert again.config["format"] == 2 and again.blob_blocks == 16 and again.config["id"] == repo.config["id"]
    assert not again.upgrade()["upgraded"]
    assert not [k for k in bucket.objects if "/locks/" in k]
    again.put_json("config", dict(again.config, format=3))
    with pytest.raises(IntegrityError, match="format 3 is not one this Capsule reads.*upgrade Capsule"):
        Repository.open(bucket, b"pass one")
    for bad in (0, 65, "16", None):
        again.put_json("config", dict(again.config, format=2, blob_blocks=bad))
        with pytest.raises(IntegrityError, match="blob_blocks"):
            _ = Repository.open(bucket, b"pass one").blob_blocks
