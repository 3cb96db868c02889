"""What a fleet host does when a rollout ``--via`` a repository asks it: restore one version from the
repository into this store (only the objects it lacks), with the S3 credentials and the repository's opened
key the rollout hands it for this one call.

The request (``POST /v1/fleet/restore``)::

    {"repository": "s3://HOST:PORT/BUCKET/PREFIX" (or s3+http://…), "ref": "NAME@V",
     "key": {"id": KEY_ID, "master": base64 of the 64-byte master key},
     "credentials": {"access_key": A, "secret_key": S, "session_token": T (optional)},
     "region": R (optional: the origin's signing region, else this host's AWS_REGION or us-east-1)}

Every field is checked before the repository is contacted: the URL's scheme, host, port and bucket, the
version ref, the key's id and size, the credentials' lengths and characters; an unknown field is refused.
The key and the credentials live in memory for the call and are dropped with it: never written to this
store, never in a log line or an error message (the audit line names the route, not the body)."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from capsule.errors import IntegrityError, InvalidName
from capsule.names import check_host, parse_ref
from capsule.repo.crypto import MasterKey
from capsule.repo.format import is_id
from capsule.repo.s3 import Credentials, Location, parse_url

if TYPE_CHECKING:
    from capsule.exchange.fleet import Activity
    from capsule.repo.restore import RestoreReport
    from capsule.store import Store

FIELDS = frozenset({"repository", "ref", "key", "credentials"})
OPTIONAL = frozenset({"region"})
MAX_URL = 1024
MAX_ACCESS_KEY = 128
MAX_SECRET_KEY = 256
MAX_SESSION_TOKEN = 4096
MASTER_BYTES = 64
_REGION = re.compile(r"[a-z0-9-]{1,32}")


@dataclass(frozen=True)
class RestoreRequest:
    location: Location
    ref: str
    key_id: str
    key: MasterKey = field(repr=False)
    credentials: Credentials = field(repr=False)
    region: str | None = None


def _text(value: Any, what: str, lo: int, hi: int) -> str:
    """A printable ASCII string of ``lo``..``hi`` characters without spaces (its value never in the message)."""
    if not isinstance(value, str) or not lo <= len(value) <= hi \
            or any(not 33 <= ord(c) <= 126 for c in value):
        raise InvalidName(f"{what} must be {lo} to {hi} printable ASCII characters with no spaces")
    return value


def _location(url: Any) -> Location:
    if not isinstance(url, str) or not 1 <= len(url) <= MAX_URL or any(c.isspace() or ord(c) < 32 for c in url):
        raise InvalidName(f"repository must be an s3:// or s3+http:// URL of at most {MAX_URL} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidName(f"invalid repository URL {url!r}: {exc}") from exc
    if parts.username or parts.password:
        raise InvalidName("invalid repository URL: no user or password in it (credentials go in "
                          "\"credentials\"; the URL is not repeated here, it held one)")
    if port == 0:
        raise InvalidName(f"invalid repository URL {url!r}: port 0")
    location = parse_url(url)                    # scheme, bucket, prefix, no query or '..'
    check_host(parts.hostname or "", "repository host")
    return location


def _key(value: Any) -> tuple[str, MasterKey]:
    if not isinstance(value, dict) or set(value) != {"id", "master"}:
        raise InvalidName('key must be {"id": KEY_ID, "master": BASE64} (the repository\'s opened key)')
    key_id, master = value["id"], value["master"]
    if not isinstance(key_id, str) or len(key_id) != 32 or not is_id(key_id):
        raise InvalidName("key.id is not a repository key id")
    if not isinstance(master, str) or len(master) > 4 * MASTER_BYTES:
        raise InvalidName(f"key.master must be the base64 of {MASTER_BYTES} bytes")
    try:
        raw = base64.b64decode(master, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidName(f"key.master must be the base64 of {MASTER_BYTES} bytes") from exc
    if len(raw) != MASTER_BYTES:
        raise InvalidName(f"key.master must be the base64 of {MASTER_BYTES} bytes, not {len(raw)}")
    return key_id, MasterKey(raw[:32], raw[32:])


def _credentials(value: Any) -> Credentials:
    if not isinstance(value, dict) or not {"access_key", "secret_key"} <= set(value) \
            or not set(value) <= {"access_key", "secret_key", "session_token"}:
        raise InvalidName('credentials must be {"access_key": A, "secret_key": S} and optionally "session_token"')
    token = value.get("session_token")
    return Credentials(_text(value["access_key"], "credentials.access_key", 1, MAX_ACCESS_KEY),
                       _text(value["secret_key"], "credentials.secret_key", 1, MAX_SECRET_KEY),
                       None if token is None else _text(token, "credentials.session_token", 1, MAX_SESSION_TOKEN))


def parse_restore_request(req: Any) -> RestoreRequest:
    """The checked fields of a restore request, or InvalidName saying what is wrong (before any contact)."""
    if not isinstance(req, dict):
        raise InvalidName("malformed restore request: expected a JSON object")
    unknown = set(req) - FIELDS - OPTIONAL
    if unknown:
        raise InvalidName(f"unknown field(s) in a restore request: {', '.join(sorted(map(str, unknown)))[:200]}")
    missing = FIELDS - set(req)
    if missing:
        raise InvalidName(f"a restore request needs {', '.join(sorted(missing))} "
                          "(repository URL, ref NAME@V, the opened key and the S3 credentials)")
    location = _location(req["repository"])
    ref = req["ref"]
    if not isinstance(ref, str) or len(ref) > 80 or parse_ref(ref).version is None:
        raise InvalidName(f"a restore request names one version (NAME@V), not {str(ref)[:80]!r}")
    key_id, key = _key(req["key"])
    region = req.get("region")
    if region is not None and (not isinstance(region, str) or not _REGION.fullmatch(region)):
        raise InvalidName("region must be 1 to 32 lower-case letters, digits or '-' (like eu-west-1)")
    return RestoreRequest(location, ref, key_id, key, _credentials(req["credentials"]), region)


def restore_from(store: Store, req: Any, activity: Activity) -> RestoreReport:
    """Restore the request's NAME@V from its repository into this store; a key that does not open the
    repository is refused before anything is read of the version."""
    from capsule.repo.repository import Repository
    from capsule.repo.restore import restore
    from capsule.repo.s3 import S3Client

    r = parse_restore_request(req)
    client = S3Client(r.location, r.credentials, region=r.region)
    try:
        repo = Repository(client, r.key, r.key_id, {})
        try:
            repo.config = repo.get_json("config", "the repository's config")
        except IntegrityError as exc:
            raise InvalidName(f"the key given does not open the repository at {r.location.url}: nothing was "
                              "restored") from exc
        report = restore(store, r.ref, repo)
    finally:
        client.close()
    activity.pulled(r.ref, r.location.url, report.downloaded_bytes)
    return report
