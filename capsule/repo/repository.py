"""Opening a repository, its keys, and reading and writing its sealed objects (layouts: :mod:`.format`)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import zstandard

from capsule.errors import AlreadyExists, AuthFailed, Conflict, Error, IntegrityError, NotFound, Unreachable
from capsule.repo import crypto
from capsule.repo.format import BLOB_BLOCKS, MAX_BLOB_BLOCKS, PACK_SIZE, Entry, decode_index, is_id, new_id
from capsule.repo.s3 import Location, S3Client, credentials_from_environment, parse_url

FORMAT = 2
FORMATS = (1, 2)       # what this Capsule reads (and writes, as the config says)
STALE_LOCK_SECONDS = 30 * 60     # a lock not refreshed for this long is a dead writer's (restic's rule)
REFRESH_LOCK_SECONDS = 5 * 60
MAX_RECORD_BYTES = 64 * 1024 * 1024


def stale(body: dict[str, Any], now: float | None = None) -> bool:
    """Whether a lock (its JSON body) is a dead writer's: not refreshed for :data:`STALE_LOCK_SECONDS`, or taken on
    this host by a process that no longer runs (restic's rules: a crashed prune frees the repository at once on its
    own host, after half an hour elsewhere)."""
    now = time.time() if now is None else now
    try:
        taken = float(body.get("time", 0))
    except (TypeError, ValueError):
        return True                   # a lock without a readable time holds nothing
    if not math.isfinite(taken) or now - taken > STALE_LOCK_SECONDS:
        return True
    pid = body.get("pid")
    if body.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False                  # it runs, as another user
    return False


def connect(url: str) -> S3Client:
    return S3Client(parse_url(url), credentials_from_environment())


@dataclass
class Repository:
    client: S3Client
    key: crypto.MasterKey
    key_id: str
    config: dict[str, Any]

    @property
    def location(self) -> Location:
        return self.client.location

    @property
    def pack_size(self) -> int:
        return int(self.config.get("pack_size", PACK_SIZE))

    @property
    def blob_blocks(self) -> int:
        """Blocks a new blob holds: 1 in a format-1 repository (one block a blob, sealed with its id)."""
        if self.config.get("format") == 1:
            return 1
        value = self.config.get("blob_blocks", BLOB_BLOCKS)
        if type(value) is not int or not 1 <= value <= MAX_BLOB_BLOCKS:
            raise IntegrityError(f"{self.location.url}: its config's blob_blocks {value!r} is not 1 to "
                                 f"{MAX_BLOB_BLOCKS}")
        return value

    # -- making and opening --------------------------------------------------------
    @classmethod
    def init(cls, client: S3Client, secret: bytes, *, pack_size: int = PACK_SIZE, blob_blocks: int = BLOB_BLOCKS,
             scrypt_n: int = crypto.SCRYPT_N, fmt: int = FORMAT) -> Repository:
        """A new repository at the client's location (the bucket is made if missing); AlreadyExists if one is
        there. ``fmt`` 1 makes one that Capsules before format 2 can use too."""
        if fmt not in FORMATS:
            raise ValueError(f"repository format {fmt} is not one of {FORMATS}")
        if not client.bucket_exists():
            client.create_bucket()
        loc = client.location
        if client.head(loc.key("config")) is not None:
            raise AlreadyExists(f"{loc.url} holds a repository already")
        master = crypto.MasterKey.new()
        key_id = new_id()
        client.put(loc.key(f"keys/{key_id}"), crypto.seal_master(master, secret, key_id, n=scrypt_n))
        config = {"format": fmt, "id": new_id(), "created": time.time(), "pack_size": pack_size}
        if fmt >= 2:
            config["blob_blocks"] = blob_blocks
        repo = cls(client, master, key_id, config)
        repo.put_json("config", config)   # last: a repository exists once it has one
        return repo

    @classmethod
    def open(cls, client: S3Client, secret: bytes) -> Repository:
        """The repository at the client's location, opened with the first key ``secret`` opens."""
        loc = client.location
        if client.head(loc.key("config")) is None:
            raise NotFound(f"no repository at {loc.url} (make one with `capsule repo init {loc.url}`)")
        for name, _size in client.list(loc.key("keys/")):
            key_id = name.rsplit("/", 1)[-1]
            if not is_id(key_id):
                continue
            master = crypto.open_master(client.get(name), secret, key_id)
            if master is not None:
                repo = cls(client, master, key_id, {})
                repo.config = repo.get_json("config", "the repository's config")
                if repo.config.get("format") not in FORMATS:
                    raise IntegrityError(f"{loc.url}: repository format {repo.config.get('format')} is not one "
                                         f"this Capsule reads ({', '.join(map(str, FORMATS))}): upgrade Capsule")
                return repo
        raise AuthFailed(f"wrong passphrase or key file: no key of the repository at {loc.url} opens with it")

    def upgrade(self) -> dict[str, Any]:
        """Make a format-1 repository format 2: new blobs hold up to :data:`BLOB_BLOCKS` blocks compressed
        together. Nothing already stored is rewritten (this Capsule reads both); a Capsule that reads only
        format 1 refuses the repository from then on, so upgrade every host first. Under the exclusive lock."""
        before = self.config.get("format")
        if before == FORMAT:
            return {"url": self.location.url, "format": FORMAT, "upgraded": False}
        with self.lock(exclusive=True):
            config = dict(self.config, format=FORMAT, blob_blocks=BLOB_BLOCKS, upgraded=time.time())
            self.put_json("config", config)     # one PUT: readers see the old config or the new, whole
            self.config = config
        return {"url": self.location.url, "format": FORMAT, "from": before, "upgraded": True}

    # -- sealed objects ------------------------------------------------------------
    def put_sealed(self, name: str, data: bytes) -> int:
        body = self.key.seal(data, name)
        self.client.put(self.location.key(name), body)
        return len(body)

    def get_sealed(self, name: str, what: str) -> bytes:
        return self.key.open(self.client.get(self.location.key(name)), name, what)

    def put_json(self, name: str, value: Any) -> int:
        return self.put_sealed(name, zstandard.ZstdCompressor().compress(json.dumps(value).encode()))

    def get_json(self, name: str, what: str) -> Any:
        try:
            raw = zstandard.ZstdDecompressor().decompress(self.get_sealed(name, what),
                                                          max_output_size=MAX_RECORD_BYTES)
            return json.loads(raw)
        except (zstandard.ZstdError, ValueError) as exc:
            raise IntegrityError(f"{what} is malformed: {exc}") from exc

    def names(self, folder: str) -> Iterator[tuple[str, int]]:
        """(name relative to the prefix, size) of the objects in ``folder``/."""
        cut = len(self.location.key(""))
        for key, size in self.client.list(self.location.key(folder + "/")):
            yield key[cut:], size

    # -- keys ----------------------------------------------------------------------
    def list_keys(self) -> list[dict[str, Any]]:
        out = []
        for name, _size in self.names("keys"):
            key_id = name.split("/", 1)[1]
            info = crypto.key_info(self.client.get(self.location.key(name)), key_id)
            out.append({"id": key_id, "created": info.get("created"), "host": info.get("host"),
                        "current": key_id == self.key_id})
        return out

    def add_key(self, secret: bytes) -> str:
        key_id = new_id()
        self.client.put(self.location.key(f"keys/{key_id}"), crypto.seal_master(self.key, secret, key_id))
        return key_id

    def remove_key(self, key_id: str) -> None:
        ids = [k["id"] for k in self.list_keys()]
        if key_id not in ids:
            raise NotFound(f"no key {key_id} in {self.location.url} (`capsule repo key ls` lists them)")
        if key_id == self.key_id:
            raise Conflict(f"key {key_id} is the one this command opened the repository with: open it with "
                           "another key to remove this one")
        self.client.delete(self.location.key(f"keys/{key_id}"))

    # -- indexes and records -------------------------------------------------------
    def load_index(self) -> tuple[dict[bytes, Entry], list[str]]:
        """Every block id the repository's indexes list, and the names of those indexes."""
        out: dict[bytes, Entry] = {}
        names = []
        for name, _size in self.names("index"):
            if not is_id(name.split("/", 1)[1]):
                continue
            out.update(decode_index(self.get_sealed(name, f"index {name}"), f"index {name}"))
            names.append(name)
        return out, names

    def manifest_names(self) -> set[str]:
        return {name.split("/", 1)[1] for name, _ in self.names("manifests")}

    def versions(self) -> list[tuple[str, dict[str, Any]]]:
        """(object name, body) of every version record, oldest push first."""
        out = []
        for name, _size in self.names("versions"):
            out.append((name, self.get_json(name, f"version record {name}")))
        out.sort(key=lambda nb: nb[1].get("pushed", 0))
        return out

    # -- locks (restic's rule: writers share, prune is alone) ------------------------
    def _locks(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for name, _size in self.names("locks"):
            try:
                out.append((name, self.get_json(name, f"lock {name}")))
            except NotFound:
                continue        # removed while listed
        return out

    @contextmanager
    def lock(self, exclusive: bool = False, *, reading: bool = False) -> Iterator[Lock]:
        """A shared lock (pushes, restores, checks) or the exclusive one (prune). ``reading``: the caller only
        reads and verifies what it reads, so when the store refuses the lock object (a store that lost a
        volume server still serves reads, not writes) it goes on without one — a prune running beside it
        could at worst make it fail, never make it take a wrong block."""
        name = f"locks/{new_id()}"
        lock = Lock(self, name, exclusive)
        try:
            lock.refresh()
        except Unreachable:
            if not reading:
                raise
            yield lock
            return
        try:
            now = time.time()
            for other, body in self._locks():
                if other == name or stale(body, now):
                    continue
                if exclusive or body.get("exclusive"):
                    who = f"{body.get('host')} pid {body.get('pid')}"
                    doing = "prune" if body.get("exclusive") else "a push, restore or check"
                    raise Conflict(f"the repository is locked by {who} ({doing}, {other}); try again when it "
                                   "is done")
            yield lock
        finally:
            with suppress(Error):   # a lock left behind goes stale, and prune or unlock removes it
                self.client.delete(self.location.key(name))

    def unlock(self, everything: bool = False) -> list[dict[str, Any]]:
        """Remove the locks of dead writers (:func:`stale`), or with ``everything`` every lock (only when no
        Capsule uses the repository: a live writer's lock removed lets a prune run beside it). What was removed:
        each lock's name, host, pid, time and whether it was exclusive."""
        removed = []
        for name, body in self._locks():
            if everything or stale(body):
                self.client.delete(self.location.key(name))
                removed.append({"lock": name, "host": body.get("host"), "pid": body.get("pid"),
                                "time": body.get("time"), "exclusive": bool(body.get("exclusive"))})
        return removed


@dataclass
class Lock:
    repo: Repository
    name: str
    exclusive: bool
    written: float = 0.0

    def refresh(self, *, if_due: bool = False) -> None:
        if if_due and time.time() - self.written < REFRESH_LOCK_SECONDS:
            return
        self.written = time.time()
        self.repo.put_json(self.name, {"exclusive": self.exclusive, "host": socket.gethostname(),
                                       "pid": os.getpid(), "time": self.written})
