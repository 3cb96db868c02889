"""Receiving pushed objects (HCP §4.4.3 with the roles reversed), without HTTP.

Per object the sender calls ``begin`` once per part of the manifest (sent in parts so that planning
one overlaps the upload of the next and of the blocks already asked for), ``accept`` per batch of
blocks (``lacking`` when an upload's answer was lost: which of its blocks to send again), and
``commit``. All state lives on disk under ``recv/``: the manifest (or its parts so far) and the
object's shadow (its verified blocks). Open receivers are only a cache rebuilt from those files,
so a receive interrupted anywhere (the sender gone, this process killed) resumes where it stopped."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zstandard

from capsule.accounts.model import Grant
from capsule.errors import Conflict, IntegrityError, InvalidName, NotFound
from capsule.exchange import holdings
from capsule.exchange.leases import LeaseCache
from capsule.exchange.streams import Streams
from capsule.names import check_object_id
from capsule.store import Store
from capsule.store.fsutil import translating_enospc
from capsule.store.objectio import (
    ChainReader,
    check_kind,
    has_object,
    install_received,
    object_manifest,
    object_path,
    open_shadow,
)
from hashcache import delta
from hashcache.atomic import write_atomic
from hashcache.blocks import BLOCK_SIZE
from hashcache.bounds import MAX_OBJECT_SIZE
from hashcache.errors import ManifestMismatch
from hashcache.hcp import (
    MAX_BATCH,
    MAX_PART_RECORDS,
    PREFIX_SIZE,
    Expectation,
    ProtocolError,
    Receiver,
    decode_indices,
    decompress_bounded,
    encode_indices,
    like_records,
    unpack_blocks,
)
from hashcache.manifest import RECORD_SIZE
from hashcache.shadow import Shadow

# a manifest part as uploaded: its header (at most 4 KiB) and at most MAX_PART_RECORDS records of at most 40 bytes
MAX_MANIFEST_UPLOAD = 8 + 4096 + MAX_PART_RECORDS * RECORD_SIZE
MAX_BLOCKS_UPLOAD = MAX_BATCH * 4096 + (1 << 20)
MAX_LACKING_UPLOAD = MAX_BATCH * 10   # a batch's indices, each a varint of at most 10 bytes
MAX_PARTS = 4096


# -- the wire format of the receiving calls -------------------------------------------------------------

def decode_manifest_upload(raw: bytes, like: bytes | None = None) -> bytes:
    """A manifest part as uploaded (zstd; against ``like``, the records of a like manifest, if given)."""
    return decompress_bounded(raw, MAX_MANIFEST_UPLOAD, "manifest", dictionary=like)


def encode_plan(needed: list[int]) -> bytes:
    """The indices still needed, as answered to ``begin`` (zstd of varints)."""
    return zstandard.ZstdCompressor(level=3).compress(encode_indices(needed))


def split_blocks_upload(raw: bytes) -> tuple[bytes, bytes]:
    """A block upload (u32 n, n bytes of varint indices, packed blocks) → (indices, blocks)."""
    if len(raw) < 4:
        raise ProtocolError("truncated block upload")
    (n,) = struct.unpack_from("<I", raw)
    if n > len(raw) - 4:
        raise ProtocolError("truncated block upload")
    return raw[4:4 + n], raw[4 + n:]


# -- the receiving side ----------------------------------------------------------------------------------

class _Incoming:
    """An open receiver of one object and the manifest state it knows."""

    def __init__(self, shadow: Shadow, receiver: Receiver, seen: tuple[bool, int]) -> None:
        self.shadow = shadow
        self.receiver = receiver
        self.seen = seen
        self.lock = threading.Lock()

    def close(self) -> None:
        self.shadow.close()


class Inbox:
    """The receiving side of push for one store, shared by request threads."""

    def __init__(self, store: Store, cache_size: int = 8) -> None:
        self.store = store
        self._receivers: LeaseCache[tuple[str, str], _Incoming] = LeaseCache(self._open, _Incoming.close,
                                                                              cache_size)
        # Manifest parts become one whole manifest file while block uploads read them: both sides hold
        # this lock, so a reader never meets a part that was just folded away.
        self._manifest_files = threading.Lock()
        self.streams = Streams()

    def close(self) -> None:
        self._receivers.close()

    # -- the three calls ---------------------------------------------------------------------------------

    def begin(self, kind: str, oid: str, manifest_part: bytes, *, part: int = 0, parts: int = 1,
              hash: bool = True, reader: Grant | None = None) -> list[int] | None:
        """Part ``part`` of ``parts`` of the manifest of ``kind`` ``oid`` (an Expectation's bytes).
        Returns the data blocks of this part still needed (not in the shadow of an interrupted receive,
        not in the hash cache when ``hash``, one per distinct hash), or None if the object is here.
        ``reader``: the grant pushing (None: a user's token): only blocks of objects it may read count as
        held, and a parent it may not read is refused (:mod:`capsule.exchange.holdings`)."""
        check_kind(kind)
        check_object_id(oid)
        if not 0 <= part < parts <= MAX_PARTS:
            raise InvalidName(f"bad manifest part {part} of {parts}")
        m = Expectation.from_bytes(manifest_part, oid)
        if len(m) > MAX_PART_RECORDS:
            raise ProtocolError(f"a manifest part holds at most {MAX_PART_RECORDS} records, not {len(m)}")
        if m.header["kind"] != kind:
            raise ProtocolError(f"{kind} {oid[:12]}: the uploaded manifest is of a {m.header['kind']}")
        if has_object(self.store, kind, oid):
            return None
        parent = m.header.get("parent")
        if kind == "layer" and parent:
            holdings.check_parent(self.store, reader, self._name(kind, oid), parent)
        if kind == "layer" and parent and not has_object(self.store, "layer", parent):
            raise Conflict(f"layer {oid[:12]} needs its parent {parent[:12]} first")
        if part == 0:
            self._receivers.drop((kind, oid))
            self.streams.drop((kind, oid))
        (self.store.home / "recv").mkdir(exist_ok=True)
        final = self._expect_path(kind, oid)
        with self._manifest_files, translating_enospc(f"receiving the manifest of {kind} {oid[:12]}"):
            if part == 0:  # a new transfer (the shadow, with its verified blocks, stays)
                final.unlink(missing_ok=True)
                for p in self._part_paths(kind, oid):
                    p.unlink()
            elif self._has_part(kind, oid, part, parts, m, manifest_part):
                # the same part again (its answer was lost and the sender tried again): already here
                with open_shadow(self.store, kind, m, fresh=False) as shadow:
                    cache = holdings.lookup_for(self.store, reader) if hash else None
                    return Receiver(m, shadow, self._name(kind, oid), cache, dedupe=hash).plan()
            elif len(self._part_paths(kind, oid)) != part:
                raise Conflict(f"{kind} {oid[:12]}: manifest part {part} arrived before the parts before it")
            target = final if parts == 1 else final.with_suffix(f".part{part}")
            write_atomic(target, manifest_part, durable=False)
            if parts > 1 and part == parts - 1:
                whole = Expectation.concat([Expectation.from_bytes(p.read_bytes(), oid)
                                            for p in self._part_paths(kind, oid)])
                write_atomic(final, whole.to_bytes(), durable=False)
                for p in self._part_paths(kind, oid):
                    p.unlink()
        with open_shadow(self.store, kind, m, fresh=part == 0) as shadow:
            cache = holdings.lookup_for(self.store, reader) if hash else None
            return Receiver(m, shadow, self._name(kind, oid), cache, dedupe=hash).plan()

    def like(self, fid: str, first: int, last: int, hash_len: int, reader: Grant | None = None) -> bytes:
        """What a manifest part that names file ``fid`` as its *like* was compressed against: ``fid``'s records
        of blocks ``first .. last`` (``hashcache.hcp.like_records``). Conflict if ``fid`` is not held here or
        ``reader`` may not read it (the sender then sends the part without it)."""
        check_object_id(fid)
        if hash_len not in (PREFIX_SIZE, RECORD_SIZE - 8) or not 0 <= first <= last < MAX_OBJECT_SIZE // BLOCK_SIZE:
            raise InvalidName(f"bad like span {first}..{last} or hash length {hash_len}")
        if not holdings.readable_file(self.store, reader, fid):
            raise Conflict(f"file {fid[:12]} is not held here (or not one this grant may read): send the manifest "
                           "part without it")
        return like_records(object_manifest(self.store, "file", fid), first, last, hash_len)

    def accept(self, kind: str, oid: str, indices: list[int], blocks: list[bytes]) -> int:
        """Keep blocks of a begun receive, each checked against its manifest hash. A wrong block raises
        ManifestMismatch naming the object and the block (the blocks before it are kept)."""
        with self._lease(kind, oid) as incoming, translating_enospc(f"receiving {kind} {oid[:12]}"):
            incoming.receiver.accept(indices, blocks)
        return len(indices)

    def accept_upload(self, kind: str, oid: str, raw: bytes, compressed: bool = True) -> int:
        """``accept`` for a block upload as it travels (see ``split_blocks_upload``)."""
        raw_indices, payload = split_blocks_upload(raw)
        with self._lease(kind, oid) as incoming, translating_enospc(f"receiving {kind} {oid[:12]}"):
            indices = decode_indices(raw_indices, incoming.receiver.manifest.block_count)
            incoming.receiver.accept(indices, unpack_blocks(payload, len(indices), compressed=compressed))
        return len(indices)

    def accept_segment(self, kind: str, oid: str, raw: bytes, stream: str, seq: int, codec: str = "zstd") -> int:
        """``accept`` for segment ``seq`` of object stream ``stream`` in ``codec`` (``capsule/exchange/streams.py``):
        the upload's payload is that segment, not a frame of its own. A segment taken before is not taken
        again; one whose predecessors this receiver lacks raises ObjectStreamLost."""
        raw_indices, payload = split_blocks_upload(raw)
        with self._lease(kind, oid) as incoming, translating_enospc(f"receiving {kind} {oid[:12]}"):
            indices = decode_indices(raw_indices, incoming.receiver.manifest.block_count)
            self.streams.take((kind, oid), stream, seq, len(indices), payload,
                              lambda blocks: incoming.receiver.accept(indices, blocks), codec)
        return len(indices)

    def accept_deltas(self, kind: str, oid: str, raw: bytes, reader: Grant | None = None) -> tuple[int, int]:
        """A block upload of deltas (``hashcache/delta.py``): each block rebuilt from blocks of the disk the
        object's parent layer shows, read from this store, and checked against its manifest hash before any
        is kept. Returns (blocks kept, blocks unresolved: their references could not be read here; the
        sender sends those again whole). A block that does not match raises IntegrityError naming it, and
        nothing of the upload is kept. ``reader``: the grant pushing (None: a user's token), refused
        (Forbidden, nothing kept) when the parent is not an object it may read."""
        raw_indices, payload = split_blocks_upload(raw)
        with self._lease(kind, oid) as incoming, translating_enospc(f"receiving {kind} {oid[:12]}"):
            receiver = incoming.receiver
            parent = receiver.manifest.header.get("parent")
            if kind != "layer" or not parent:
                raise ProtocolError(f"{kind} {oid[:12]}: deltas are for a layer with a parent, this has none")
            holdings.check_parent(self.store, reader, self._name(kind, oid), parent)
            indices = decode_indices(raw_indices, receiver.manifest.block_count)

            def expected(index: int) -> bytes:
                rec = receiver.manifest.record(index)
                if rec is None or rec[0]:
                    raise ProtocolError(f"{kind} {oid[:12]}: block {index} is not a data block of this object")
                return rec[1]

            if not has_object(self.store, "layer", parent):
                delta.unpack(payload, indices, receiver.manifest.block_count)   # refused if malformed, still
                good: list[tuple[int, bytes]] = []
                unresolved = sorted(indices)
            else:
                with ChainReader(self.store, parent) as chain:
                    deltas = delta.unpack(payload, indices, chain.block_count)
                    try:
                        good, unresolved = delta.rebuild_all(self._name(kind, oid), deltas, chain.read, expected)
                    except ManifestMismatch as exc:
                        raise IntegrityError(str(exc)) from exc
            receiver.accept([i for i, _b in good], [b for _i, b in good])
        return len(good), len(unresolved)

    def lacking(self, kind: str, oid: str, raw_indices: bytes) -> list[int]:
        """Which of a batch's blocks (varint indices, as uploaded) this receive has not kept: asked by a
        sender whose upload got no answer (this process was killed, the link broke), so that it sends
        again only those. An object already installed lacks none."""
        check_kind(kind)
        check_object_id(oid)
        if has_object(self.store, kind, oid):
            return []
        with self._lease(kind, oid) as incoming:
            indices = decode_indices(raw_indices, incoming.receiver.manifest.block_count)
            return incoming.shadow.missing(indices)

    def commit(self, kind: str, oid: str, role: str = "memory") -> bool:
        """Verify the complete object against its digest, install and record it. Returns False if it
        was here already. A digest mismatch throws the received blocks away (the sender starts over)."""
        check_kind(kind)
        check_object_id(oid)
        if has_object(self.store, kind, oid):
            return False
        if not self._expect_path(kind, oid).exists():
            raise Conflict(f"{kind} {oid[:12]}: not every part of its manifest has arrived")
        m = self._manifest(kind, oid)
        self._receivers.drop((kind, oid))
        self.streams.drop((kind, oid))
        shadow = open_shadow(self.store, kind, m)
        try:
            receiver = Receiver(m, shadow, self._name(kind, oid))
            if not receiver.complete():
                raise Conflict(f"{kind} {oid[:12]} is not complete yet")
            try:
                manifest = receiver.finish()
            except ManifestMismatch:
                shadow.remove()  # the sender's data was wrong somewhere: start over
                self._expect_path(kind, oid).unlink(missing_ok=True)
                raise
            install_received(self.store, kind, manifest, shadow, role=role, hashed=True)
        finally:
            shadow.close()
        self.store.index_object(object_path(self.store, kind, oid), manifest)
        self._expect_path(kind, oid).unlink(missing_ok=True)
        return True

    # -- open receivers ------------------------------------------------------------------------------------

    @contextmanager
    def _lease(self, kind: str, oid: str) -> Iterator[_Incoming]:
        """The object's open receiver, up to date with the manifest on disk, held while in use."""
        check_kind(kind)
        check_object_id(oid)
        with self._receivers.lease((kind, oid)) as incoming:
            self._refresh(kind, oid, incoming)
            yield incoming

    def _open(self, key: tuple[str, str]) -> _Incoming:
        kind, oid = key
        state = self._manifest_state(kind, oid)  # before reading: a part landing meanwhile is seen next time
        m = self._manifest(kind, oid)
        shadow = open_shadow(self.store, kind, m)
        try:
            return _Incoming(shadow, Receiver(m, shadow, self._name(kind, oid)), state)
        except BaseException:
            shadow.close()
            raise

    def _refresh(self, kind: str, oid: str, incoming: _Incoming) -> None:
        """Bring a cached receiver up to date with the manifest parts on disk (a block of a part can
        arrive right after that part was planned)."""
        state = self._manifest_state(kind, oid)
        if state == incoming.seen:
            return
        with incoming.lock:
            if state != incoming.seen:
                incoming.receiver.update(self._manifest(kind, oid))
                incoming.seen = state

    # -- the manifest on disk ------------------------------------------------------------------------------

    def _expect_path(self, kind: str, oid: str) -> Path:
        return self.store.home / "recv" / f"{check_kind(kind)}-{check_object_id(oid)}.expect"

    def _has_part(self, kind: str, oid: str, part: int, parts: int, m: Expectation, raw: bytes) -> bool:
        """Whether part ``part`` (> 0) of this manifest arrived already with these very records: the last
        part on disk, or, once the parts were folded into the whole manifest, its tail."""
        on_disk = self._part_paths(kind, oid)
        if on_disk:
            return len(on_disk) == part + 1 and on_disk[-1].read_bytes() == raw
        final = self._expect_path(kind, oid)
        if part != parts - 1 or not final.exists():
            return False
        whole = Expectation.from_bytes(final.read_bytes(), oid)
        n = len(m.keys)
        return (n <= len(whole.keys) and whole.keys[len(whole.keys) - n:] == m.keys
                and whole.hashes.endswith(m.hashes))

    def _part_paths(self, kind: str, oid: str) -> list[Path]:
        base = self._expect_path(kind, oid)
        return sorted(base.parent.glob(base.stem + ".part*"), key=lambda p: int(p.suffix[5:]))

    def _manifest_state(self, kind: str, oid: str) -> tuple[bool, int]:
        """What of the manifest is on disk: whole, or how many parts (a part may land at any time)."""
        with self._manifest_files:
            return self._expect_path(kind, oid).exists(), len(self._part_paths(kind, oid))

    def _manifest(self, kind: str, oid: str) -> Expectation:
        """The whole manifest once every part has arrived; before that, the parts so far."""
        path = self._expect_path(kind, oid)
        with self._manifest_files:
            if path.exists():
                return Expectation.from_bytes(path.read_bytes(), oid)
            parts = self._part_paths(kind, oid)
            if not parts:
                raise NotFound(f"no transfer of {kind} {oid[:12]} has begun here")
            raw = [p.read_bytes() for p in parts]
        return Expectation.concat([Expectation.from_bytes(r, oid) for r in raw])

    @staticmethod
    def _name(kind: str, oid: str) -> str:
        return f"{kind} {oid[:12]}"

