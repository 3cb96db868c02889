"""The repository's keys and its one sealing rule.

A repository has one master key: 64 random bytes, the first 32 the AES-256-GCM key every pack blob, index,
manifest, version record, lock and the config are sealed with, the last 32 the id key that names blocks
(HMAC-SHA256, as borg's ``id_hash``: whoever holds the bucket cannot confirm a known block by its hash).
The master key itself lives only sealed, in ``keys/ID`` objects: each seals it with a key derived by scrypt
from a passphrase (or a key file's bytes), so several passphrases may open one repository.

A sealed object is ``MAGIC | nonce (12) | AES-256-GCM ciphertext and tag``, the object's name its associated
data: an object copied over another's name is refused as tampered."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from capsule.errors import AuthFailed, IntegrityError, InvalidName

MAGIC = b"CRP1"
NONCE = 12
TAG = 16
OVERHEAD = len(MAGIC) + NONCE + TAG
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
_MAX_SCRYPT_N = 2**20


@dataclass(frozen=True)
class MasterKey:
    enc: bytes   # AES-256-GCM
    ids: bytes   # HMAC-SHA256 key of block and manifest ids

    @classmethod
    def new(cls) -> MasterKey:
        return cls(secrets.token_bytes(32), secrets.token_bytes(32))

    def block_id(self, block_hash: bytes) -> bytes:
        """A block's id: HMAC-SHA256 of its BLAKE3 hash (a collision-resistant digest of its bytes, from the
        object's manifest, so a block the repository holds is known without reading it)."""
        return hmac.new(self.ids, b"block\0" + block_hash, hashlib.sha256).digest()

    def object_name(self, kind: str, oid: str) -> str:
        """The keyed name of a layer's or file's manifest (its id is an unkeyed content digest)."""
        return hmac.new(self.ids, f"manifest\0{kind}\0{oid}".encode(), hashlib.sha256).hexdigest()

    def seal(self, data: bytes, name: bytes | str) -> bytes:
        nonce = secrets.token_bytes(NONCE)
        return MAGIC + nonce + AESGCM(self.enc).encrypt(nonce, data, _aad(name))

    def open(self, sealed: bytes, name: bytes | str, what: str) -> bytes:
        return open_sealed(self.enc, sealed, name, what)


def _aad(name: bytes | str) -> bytes:
    return name.encode() if isinstance(name, str) else name


def open_sealed(key: bytes, sealed: bytes, name: bytes | str, what: str) -> bytes:
    """The plaintext of ``sealed``; IntegrityError naming ``what`` if it was changed, cut or moved."""
    if len(sealed) < OVERHEAD or not sealed.startswith(MAGIC):
        raise IntegrityError(f"{what} is not a sealed repository object (truncated or foreign)")
    try:
        return AESGCM(key).decrypt(sealed[len(MAGIC):len(MAGIC) + NONCE], sealed[len(MAGIC) + NONCE:], _aad(name))
    except InvalidTag as exc:
        raise IntegrityError(f"{what} failed authentication: it was tampered with, damaged, or sealed by "
                             "another repository") from exc


def _derive(secret: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, maxmem=256 * 1024 * 1024, dklen=32)


def seal_master(master: MasterKey, secret: bytes, key_id: str, *, n: int = SCRYPT_N) -> bytes:
    """The body of ``keys/KEY_ID``: JSON (no secret in clear) with the scrypt parameters and the sealed key."""
    if not secret:
        raise InvalidName("an empty passphrase cannot seal a repository key")
    salt = secrets.token_bytes(16)
    kek = _derive(secret, salt, n, SCRYPT_R, SCRYPT_P)
    nonce = secrets.token_bytes(NONCE)
    sealed = MAGIC + nonce + AESGCM(kek).encrypt(nonce, master.enc + master.ids, f"keys/{key_id}".encode())
    body = {"format": 1, "kdf": "scrypt", "n": n, "r": SCRYPT_R, "p": SCRYPT_P,
            "salt": base64.b64encode(salt).decode(), "sealed": base64.b64encode(sealed).decode(),
            "created": time.time(), "host": socket.gethostname()}
    return json.dumps(body, sort_keys=True).encode()


def key_info(body: bytes, key_id: str) -> dict[str, Any]:
    """The clear fields of a key object (never its secret), checked."""
    try:
        info = json.loads(body)
        if not isinstance(info, dict) or info.get("format") != 1 or info.get("kdf") != "scrypt":
            raise ValueError("unknown key format")
        for field in ("n", "r", "p"):
            if not isinstance(info[field], int) or info[field] < 1:
                raise ValueError(f"bad {field}")
        if info["n"] > _MAX_SCRYPT_N or info["r"] > 32 or info["p"] > 16:
            raise ValueError("scrypt parameters out of bounds")
        base64.b64decode(info["salt"], validate=True)
        base64.b64decode(info["sealed"], validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"key {key_id} is malformed: {exc}") from exc
    return info


def open_master(body: bytes, secret: bytes, key_id: str) -> MasterKey | None:
    """The master key if ``secret`` opens key ``key_id``, else None."""
    info = key_info(body, key_id)
    kek = _derive(secret, base64.b64decode(info["salt"]), info["n"], info["r"], info["p"])
    try:
        raw = open_sealed(kek, base64.b64decode(info["sealed"]), f"keys/{key_id}", f"key {key_id}")
    except IntegrityError:
        return None
    if len(raw) != 64:
        raise IntegrityError(f"key {key_id} holds a master key of the wrong size")
    return MasterKey(raw[:32], raw[32:])


def read_secret(key_file: str | os.PathLike[str] | None, env: str = "CAPSULE_REPO_PASSPHRASE",
                prompt: str = "repository passphrase: ", *, confirm: bool = False) -> bytes:
    """The secret that opens (or seals) a key: a key file's bytes, else ``$CAPSULE_REPO_PASSPHRASE``, else a
    prompt on the terminal (twice when ``confirm``)."""
    if key_file is not None:
        try:
            data = open(key_file, "rb").read()   # noqa: SIM115 - read whole, closed by refcount
        except OSError as exc:
            raise InvalidName(f"the key file {key_file} cannot be read: {exc.strerror}") from exc
        if len(data) < 16:
            raise InvalidName(f"the key file {key_file} holds {len(data)} bytes: a key file needs 16 or more")
        return data
    value = os.environ.get(env)
    if value:
        return value.encode()
    import getpass
    import sys

    if not sys.stdin.isatty():
        raise AuthFailed(f"no repository passphrase: set {env}, pass --key-file, or run on a terminal")
    first = getpass.getpass(prompt)
    if confirm and getpass.getpass("again: ") != first:
        raise InvalidName("the two passphrases differ")
    return first.encode()
