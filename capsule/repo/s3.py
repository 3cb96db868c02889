"""A small S3 client (AWS Signature Version 4 over httpx, path-style addressing): what a capsule repository
needs of an object store and nothing more — put, get (whole or a byte range), head, delete, list, and making
the bucket. Any S3-compatible store serves (SeaweedFS's S3 gateway in the project's tests).

A repository URL is ``s3://HOST[:PORT]/BUCKET[/PREFIX]`` (HTTPS) or ``s3+http://HOST[:PORT]/BUCKET[/PREFIX]``
(plain HTTP, for a store on loopback or a trusted LAN: what travels is encrypted either way, and SigV4 never
sends the secret). Credentials: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``
optional), else the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or ``~/.aws/credentials``,
profile ``AWS_PROFILE`` or ``default``), as the AWS tools read them."""

from __future__ import annotations

import configparser
import datetime
import hashlib
import hmac
import os
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from capsule.errors import AuthFailed, Conflict, EnvironmentProblem, InvalidName, NotFound, Unreachable

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class Location:
    """Where a repository lives: the endpoint, the bucket and the key prefix (no leading or trailing /)."""

    endpoint: str   # http(s)://HOST:PORT
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        scheme = "s3+http" if self.endpoint.startswith("http://") else "s3"
        host = self.endpoint.split("://", 1)[1]
        return f"{scheme}://{host}/{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


def parse_url(url: str) -> Location:
    """``s3://HOST[:PORT]/BUCKET[/PREFIX]`` or ``s3+http://…``; raises InvalidName with what is wrong."""
    parsed = urllib.parse.urlsplit(url)
    schemes = {"s3": "https", "s3+http": "http"}
    if parsed.scheme not in schemes:
        raise InvalidName(f"not a repository URL: {url!r} (expected s3://HOST:PORT/BUCKET/PREFIX, or s3+http://… "
                          "for a store without TLS)")
    if not parsed.hostname:
        raise InvalidName(f"repository URL {url!r} names no host")
    parts = [p for p in parsed.path.split("/") if p]
    if not parts:
        raise InvalidName(f"repository URL {url!r} names no bucket (s3://HOST:PORT/BUCKET/PREFIX)")
    bucket = parts[0]
    if not (3 <= len(bucket) <= 63) or not all(c.isalnum() or c in "-." for c in bucket) or bucket != bucket.lower():
        raise InvalidName(f"bucket name {bucket!r}: 3-63 lower-case letters, digits, '-' or '.'")
    if parsed.query or parsed.fragment or any(p in (".", "..") for p in parts):
        raise InvalidName(f"repository URL {url!r} has a query, a fragment or a '.'/'..' path part")
    return Location(f"{schemes[parsed.scheme]}://{parsed.netloc}", bucket, "/".join(parts[1:]))


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)                 # never in a log line or a traceback's locals
    session_token: str | None = field(default=None, repr=False)


def credentials_from_environment() -> Credentials:
    """The AWS tools' order: the environment, then the shared credentials file."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None)
    path = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    profile = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise EnvironmentProblem(f"the credentials file {path} cannot be read: {exc}") from exc
    if parser.has_option(profile, "aws_access_key_id") and parser.has_option(profile, "aws_secret_access_key"):
        return Credentials(parser.get(profile, "aws_access_key_id"), parser.get(profile, "aws_secret_access_key"),
                           parser.get(profile, "aws_session_token", fallback=None))
    raise EnvironmentProblem("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or write them in "
                             f"{path} (profile [{profile}])")


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class S3Client:
    """Signed requests to one bucket. Thread-safe (one httpx client, its connection pool shared)."""

    def __init__(self, location: Location, credentials: Credentials, *, region: str | None = None,
                 timeout: float = 60.0) -> None:
        self.location = location
        self.creds = credentials
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.host = location.endpoint.split("://", 1)[1]
        self._http = httpx.Client(base_url=location.endpoint, timeout=timeout)
        self.sent_bytes = 0        # request bodies (what was uploaded)
        self.received_bytes = 0    # response bodies
        self._counting = threading.Lock()   # requests come from several threads (a push's uploads)

    def close(self) -> None:
        self._http.close()

    def _headers(self, method: str, path: str, query: dict[str, str], body: bytes,
                 extra: dict[str, str]) -> dict[str, str]:
        now = datetime.datetime.now(datetime.UTC)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        payload = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        headers = {"host": self.host, "x-amz-date": amz_date, "x-amz-content-sha256": payload,
                   **{k.lower(): v for k, v in extra.items()}}
        if self.creds.session_token:
            headers["x-amz-security-token"] = self.creds.session_token
        names = sorted(headers)
        canonical_query = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                                   for k, v in sorted(query.items()))
        canonical = "\n".join([method, urllib.parse.quote(path, safe="/-_.~"), canonical_query,
                               "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), payload])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        k = _sign(_sign(_sign(_sign(("AWS4" + self.creds.secret_key).encode(), day), self.region), "s3"),
                  "aws4_request")
        signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.creds.access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")
        del headers["host"]   # httpx sets it, to the same value
        return headers

    def _request(self, method: str, key: str | None, *, query: dict[str, str] | None = None, body: bytes = b"",
                 headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        path = f"/{self.location.bucket}" + (f"/{key}" if key is not None else "")
        query = query or {}
        signed = self._headers(method, path, query, body, headers or {})
        try:
            resp = self._http.request(method, urllib.parse.quote(path, safe="/-_.~"), params=query or None,
                                      content=body or None, headers=signed)
        except httpx.HTTPError as exc:
            raise Unreachable(f"the object store at {self.location.endpoint} cannot be reached: {exc}") from exc
        with self._counting:
            self.sent_bytes += len(body)
            self.received_bytes += len(resp.content)
        if resp.status_code in ok:
            return resp
        code = _error_code(resp)
        where = f"{method} {self.location.endpoint}{path}"
        if resp.status_code == 404 or code in ("NoSuchKey", "NoSuchBucket"):
            raise NotFound(f"{where}: {code or 'not found'}")
        if resp.status_code == 403 or code in ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId"):
            raise AuthFailed(f"the object store refused the credentials ({code or resp.status_code}) for {where}")
        if resp.status_code == 409:
            raise Conflict(f"{where}: {code or 'conflict'}")
        raise Unreachable(f"{where}: the object store answered {resp.status_code} {code}".rstrip())

    # -- the calls a repository makes ------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self._request("PUT", key, body=data, headers={"content-type": "application/octet-stream"})

    def get(self, key: str, start: int | None = None, length: int | None = None) -> bytes:
        headers = {}
        if start is not None:
            end = "" if length is None else str(start + length - 1)
            headers["range"] = f"bytes={start}-{end}"
        return self._request("GET", key, headers=headers, ok=(200, 206)).content

    def head(self, key: str) -> int | None:
        """The object's size, None if there is none."""
        try:
            resp = self._request("HEAD", key)
        except NotFound:
            return None
        return int(resp.headers.get("content-length", 0))

    def delete(self, key: str) -> None:
        self._request("DELETE", key, ok=(200, 204))

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object whose key starts with ``prefix``, in key order."""
        token: str | None = None
        while True:
            query = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
            if token:
                query["continuation-token"] = token
            root = ET.fromstring(self._request("GET", None, query=query).content)
            for item in root.iter(f"{_NS}Contents"):
                yield item.findtext(f"{_NS}Key") or "", int(item.findtext(f"{_NS}Size") or 0)
            if (root.findtext(f"{_NS}IsTruncated") or "false") != "true":
                return
            token = root.findtext(f"{_NS}NextContinuationToken")
            if not token:
                return

    def bucket_exists(self) -> bool:
        try:
            self._request("HEAD", None)
        except NotFound:
            return False
        return True

    def create_bucket(self) -> None:
        self._request("PUT", None, ok=(200,))


def _error_code(resp: httpx.Response) -> str:
    try:
        return ET.fromstring(resp.content).findtext("Code") or ""
    except ET.ParseError:
        return ""
