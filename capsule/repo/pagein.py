"""A repository as the source of demand-paged layers (an instant restore, ``capsule start NAME@V --from s3://…``).

The disk server (``diskserver/``) reads a remote layer's missing blocks from whatever its spec's source is; for
a layer whose source is a repository that is :class:`RepoSource`, which the disk server loads by its opener
name (:data:`OPENER`) and treats as it treats an agent: batches of block indices in, blocks out, each verified
by the chain against the layer's manifest and kept in the shadow and the hash cache.

What it needs sits beside the remote layer's manifest, written before the disk server starts:

- the *secret file* (the remote layer's ``token_file``, 0600): JSON with the repository's master key and the
  S3 credentials the restore was made with (:func:`secret_text`); it is removed, as a peer's token is, once no
  running instance reads from the repository (:func:`capsule.lifecycle.demand.release_sources`);
- per layer, its *places* (``<layer id>.places``, :func:`write_places`): for each data block its index, its
  keyed block id and where its blob is (pack, offset, length), so the disk server reads no repository index.

A read is grouped into ranged GETs (neighbouring blobs of a pack in one GET, :func:`capsule.repo.format.ranges`),
fetched a few at a time, each blob opened (AES-GCM) and decompressed, each block checked against its keyed id.
A format-2 blob holds up to 16 neighbouring blocks: the last :data:`CACHED_BLOBS` opened are kept, so the
guest's next read of a neighbour costs no second GET.
A pack a prune has removed since (its blobs repacked elsewhere) makes the source read the repository's indexes
again and retry from the blobs' new places."""

from __future__ import annotations

import base64
import json
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from capsule.errors import AuthFailed, Error, IntegrityError, NotFound, Unreachable
from capsule.repo.crypto import MasterKey
from capsule.repo.format import SINGLE, Entry, Range, block_of, open_range, pack_name, ranges
from capsule.repo.repository import Repository
from capsule.repo.s3 import Credentials, S3Client, parse_url
from diskserver.chain.spec import RetrySpec
from diskserver.errors import SourceError, SourceUnavailable
from diskserver.source import ReadResult
from hashcache.atomic import write_atomic
from hashcache.manifest import Manifest

OPENER = "capsule.repo.pagein:open_source"
SECRET_FORMAT = 1
PLACES_MAGIC, PLACES1_MAGIC = b"CPL2", b"CPL1"
PLACE = struct.Struct("<Q32s16sIIh")   # block index, block id, pack id, blob offset, blob length, slot
PLACE1 = struct.Struct("<Q32s16sII")   # CPL1, a Capsule before format 2's blobs: no slot
GET_HEADERS = 1024                     # request and answer headers of one ranged GET, roughly (SigV4 is wordy)
PARALLEL_GETS = 4
CACHED_BLOBS = 256                     # opened format-2 blobs kept (at most 64 KiB each by default)


def secret_text(repo: Repository) -> str:
    """The secret file's text for ``repo``: its master key and the credentials its client uses."""
    creds = repo.client.creds
    return json.dumps({"format": SECRET_FORMAT, "key": base64.b64encode(repo.key.enc + repo.key.ids).decode(),
                       "access_key": creds.access_key, "secret_key": creds.secret_key,
                       "session_token": creds.session_token, "region": repo.client.region})


def places_path(secret_file: str | os.PathLike[str], layer_id: str) -> Path:
    return Path(secret_file).parent / f"{layer_id}.places"


def write_places(path: Path, manifest: Manifest, key: MasterKey, index: dict[bytes, Entry]) -> int:
    """Write where each data block of ``manifest`` lives in the repository; IntegrityError if one is in no index.
    Returns the number of data blocks."""
    parts = [PLACES_MAGIC]
    missing = 0
    for i, zero, block_hash in manifest.records():
        if zero:
            continue
        bid = key.block_id(block_hash)
        entry = index.get(bid)
        if entry is None:
            missing += 1
            continue
        parts.append(PLACE.pack(i, bid, bytes.fromhex(entry.pack), entry.offset, entry.length, entry.slot))
    if missing:
        raise IntegrityError(f"layer {manifest.digest[:12]}: {missing} of its blocks are in no index of the "
                             "repository (`capsule repo check`)")
    write_atomic(path, b"".join(parts), durable=False, mode=0o600)
    return len(parts) - 1


def read_places(path: Path) -> dict[int, tuple[bytes, Entry]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"the places of a layer paged from a repository ({path}) cannot be read: "
                          f"{exc.strerror}; start the version again with `capsule start NAME@V --from URL`") from exc
    body = data[len(PLACES_MAGIC):]
    if data.startswith(PLACES1_MAGIC) and not len(body) % PLACE1.size:
        return {i: (bid, Entry(pack.hex(), off, n)) for i, bid, pack, off, n in PLACE1.iter_unpack(body)}
    if not data.startswith(PLACES_MAGIC) or len(body) % PLACE.size:
        raise SourceError(f"{path} is not a layer's places file (truncated or foreign)")
    out = {}
    for i, bid, pack, off, n, slot in PLACE.iter_unpack(body):
        if slot < SINGLE:
            raise SourceError(f"{path} is not a layer's places file (a slot of {slot})")
        out[i] = (bid, Entry(pack.hex(), off, n, slot))
    return out


def _read_secret(url: str, secret_file: str) -> tuple[MasterKey, Credentials, str | None]:
    try:
        info = json.loads(Path(secret_file).read_text())
        if not isinstance(info, dict) or info.get("format") != SECRET_FORMAT:
            raise ValueError("unknown format")
        raw = base64.b64decode(info["key"], validate=True)
        if len(raw) != 64:
            raise ValueError("a master key of the wrong size")
        creds = Credentials(str(info["access_key"]), str(info["secret_key"]), info.get("session_token") or None)
    except OSError as exc:
        raise SourceError(f"source {url}: its secret file {secret_file} cannot be read ({exc.strerror}): the "
                          "run that wrote it ended; start the version again with --from") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"source {url}: its secret file {secret_file} is malformed ({exc})") from exc
    return MasterKey(raw[:32], raw[32:]), creds, info.get("region")


class RepoSource:
    """The blocks of layers stored in one repository, for the disk server. Thread-safe."""

    def __init__(self, url: str, secret_file: str, retry: RetrySpec) -> None:
        try:
            location = parse_url(url)
        except Error as exc:
            raise SourceError(f"source {url}: {exc}") from exc
        self.url = location.url
        self.secret_file = secret_file
        self.retry = retry
        key, creds, region = _read_secret(url, secret_file)
        self.repo = Repository(S3Client(location, creds, region=region, timeout=retry.request_timeout), key, "", {})
        self._places: dict[str, dict[int, tuple[bytes, Entry]]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._blobs: OrderedDict[tuple[str, int], bytes] = OrderedDict()    # (pack, offset) → content

    def __repr__(self) -> str:
        return f"RepoSource({self.url!r})"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.repo.client.close()

    def _layer(self, layer_id: str) -> dict[int, tuple[bytes, Entry]]:
        with self._lock:
            places = self._places.get(layer_id)
            if places is None:
                places = self._places[layer_id] = read_places(places_path(self.secret_file, layer_id))
            return places

    def read_blocks(self, layer_id: str, indices: list[int]) -> ReadResult:
        """The blocks ``indices`` of layer ``layer_id``, in that order."""
        places = self._layer(layer_id)
        try:
            wanted = [places[i] for i in indices]
        except KeyError as exc:
            raise SourceError(f"layer {layer_id[:12]}: block {exc.args[0]} is no data block the repository "
                              "holds for it") from None
        got: dict[bytes, bytes] = {}
        wire = attempts = 0
        todo = ranges(self._from_cache(layer_id, wanted, got))
        for round_ in range(2):
            results = self._get_all(layer_id, todo)
            moved = []
            for r, outcome in zip(todo, results, strict=True):
                if isinstance(outcome, NotFound):
                    moved.append(r)
                    continue
                data, tries = outcome
                wire += len(data) + GET_HEADERS * tries
                attempts += tries
                got.update(self._open(layer_id, r, data))
            if not moved:
                break
            if round_:
                raise SourceError(f"layer {layer_id[:12]}: pack {moved[0].pack} is missing from the repository "
                                  f"at {self.url}, and no index places its blocks elsewhere (`capsule repo check`)")
            todo = self._relocate(layer_id, moved)
        return ReadResult([got[bid] for bid, _entry in wanted], wire, attempts)

    def _from_cache(self, layer_id: str, wanted: list[tuple[bytes, Entry]], got: dict[bytes, bytes]
                    ) -> list[tuple[bytes, Entry]]:
        """Take what opened blobs hold into ``got``; the rest, still to fetch."""
        rest = []
        for bid, entry in wanted:
            with self._lock:
                content = self._blobs.get((entry.pack, entry.offset)) if entry.slot != SINGLE else None
            if content is None:
                rest.append((bid, entry))
                continue
            try:
                got[bid] = block_of(self.repo.key, bid, content, entry.slot, f"a block of layer {layer_id[:12]}")
            except IntegrityError as exc:
                raise SourceError(f"source {self.url}: {exc}") from exc
        return rest

    def _open(self, layer_id: str, r: Range, data: bytes) -> dict[bytes, bytes]:
        opened: dict[int, bytes] = {}
        try:
            blocks = open_range(self.repo.key, r, data, f"a block of layer {layer_id[:12]} in pack {r.pack}", opened)
        except IntegrityError as exc:
            raise SourceError(f"source {self.url}: {exc}") from exc
        with self._lock:
            for offset, content in opened.items():
                self._blobs[(r.pack, offset)] = content
                self._blobs.move_to_end((r.pack, offset))
            while len(self._blobs) > CACHED_BLOBS:
                self._blobs.popitem(last=False)
        return blocks

    def _get_all(self, layer_id: str, todo: list[Range]) -> list[tuple[bytes, int] | NotFound]:
        if len(todo) == 1:
            return [self._get(layer_id, todo[0])]
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(PARALLEL_GETS, thread_name_prefix="repo-get")
        return list(self._pool.map(lambda r: self._get(layer_id, r), todo))

    def _get(self, layer_id: str, r: Range) -> tuple[bytes, int] | NotFound:
        """One range's bytes and the attempts it took (a NotFound: the pack is gone), retried while the store
        is out of reach or failing, for the retry window."""
        t0 = time.monotonic()
        delay, tries = self.retry.initial_delay, 0
        while True:
            tries += 1
            try:
                data = self.repo.client.get(self.repo.location.key(pack_name(r.pack)), r.start, r.length)
            except NotFound as exc:
                return exc
            except AuthFailed as exc:
                raise SourceError(f"layer {layer_id[:12]}: {exc}") from exc
            except Unreachable as exc:
                if time.monotonic() - t0 + delay > self.retry.seconds:
                    raise SourceUnavailable(f"layer {layer_id[:12]}: the repository at {self.url} is unreachable "
                                            f"or failing: {len(r.items)} block(s) could not be fetched within "
                                            f"{self.retry.seconds:g} s (last error: {exc})") from exc
                time.sleep(delay)
                delay = min(self.retry.max_delay, max(delay * 2, 0.01))
                continue
            if len(data) != r.length:
                raise SourceError(f"layer {layer_id[:12]}: pack {r.pack} answered {len(data)} bytes for a range "
                                  f"of {r.length}")
            return data, tries

    def _relocate(self, layer_id: str, moved: list[Range]) -> list[Range]:
        """Read the repository's indexes again (a prune repacked these blobs) and give the new ranges."""
        try:
            index, _names = self.repo.load_index()
        except Error as exc:
            raise SourceError(f"layer {layer_id[:12]}: the repository's indexes at {self.url} cannot be read: "
                              f"{exc}") from exc
        wanted = []
        for r in moved:
            for bid, _old in r.items:
                if bid not in index:
                    raise SourceError(f"layer {layer_id[:12]}: a block of pack {r.pack} is in no index of the "
                                      f"repository at {self.url} any more (was its version forgotten and pruned?)")
                wanted.append((bid, index[bid]))
        with self._lock:
            places = self._places[layer_id]
            for i, (bid, _entry) in list(places.items()):
                if bid in index:
                    places[i] = (bid, index[bid])
        return ranges(wanted)


def open_source(url: str, secret_file: str, retry: RetrySpec) -> RepoSource:
    """The opener the disk server calls for a layer whose remote spec names :data:`OPENER`."""
    return RepoSource(url, secret_file, retry)

