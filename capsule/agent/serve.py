"""Running the agent: token handling, its TLS identity, and uvicorn."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from capsule.agent.limits import Limits
from capsule.errors import InvalidName
from capsule.names import check_host
from hashcache.transport import plain, tls
from hashcache.transport.plain import is_loopback

__all__ = ["Identity", "ensure_token", "host_fingerprint", "identity", "is_loopback", "parse_listen",
           "public_url", "serve", "trusted_proxies"]

TLS_DIR = "tls"  # in the store: host.crt, host.key (0600)


def host_fingerprint(home: Path) -> str | None:
    """The fingerprint of the host key ``capsule serve`` made for the store at ``home`` (what its peers pin),
    or None before its first start."""
    cert = Path(home) / TLS_DIR / tls.CERT_NAME
    return tls.cert_fingerprint(cert) if cert.exists() else None


def ensure_token(token_file: Path) -> str:
    """Read the agent's token, creating the file (mode 0600) with a fresh one if missing."""
    if not token_file.exists():
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    token = token_file.read_text().strip()
    if len(token) < 16:
        raise InvalidName(f"the token in {token_file} is shorter than 16 characters")
    return token


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    # ASCII digits only: str.isdigit() also takes other scripts' digits ('١') and superscripts ('²')
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise InvalidName(f"--listen {listen!r}: expected HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return check_host(host or "127.0.0.1", f"--listen host in {listen!r}"), int(port)


@dataclass(frozen=True)
class Identity:
    """How the agent listens: with TLS (certificate, key, fingerprint) or, on loopback only, plain HTTP."""

    cert: Path | None
    key: Path | None
    fingerprint: str | None
    created: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.cert else "http"


def identity(home: Path, listen: str, *, insecure_http: bool = False, cert: Path | None = None,
             key: Path | None = None) -> Identity:
    """The agent's TLS identity: the user's ``cert``/``key`` (a CA-signed pair, checked to belong together),
    else the host's own self-signed pair in ``STORE/tls/`` (made on first start). ``insecure_http`` (no TLS)
    is refused unless the agent listens on loopback only."""
    host, _port = parse_listen(listen)
    if insecure_http:
        if cert or key:
            raise InvalidName("--insecure-http and --cert/--key exclude each other")
        if not is_loopback(host):
            raise InvalidName(f"--insecure-http is refused on {host}: without TLS the token, memory and disks "
                              "cross the network readable by anyone on the path. Listen on 127.0.0.1 "
                              "(or ::1), or drop --insecure-http to use TLS")
        return Identity(None, None, None)
    if (cert is None) != (key is None):
        raise InvalidName("--cert and --key go together (a certificate and its private key)")
    if cert is not None and key is not None:
        return Identity(cert, key, tls.server_fingerprint(cert, key))
    own = tls.ensure_host_cert(home / TLS_DIR)
    return Identity(own.cert, own.key, own.fingerprint, own.created)


def _every_address(host: str) -> bool:
    """0.0.0.0, :: and their spellings: every address of the machine, none of them in particular."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def public_url(scheme: str, listen: str, given: str | None = None) -> str | None:
    """The URL other hosts reach this agent at (what a demand migration hands the destination): ``given``
    (``--public-url``, checked), else ``scheme`` (what it serves: https, or http) and the host and port of
    ``listen``; None when it listens on every address (0.0.0.0, ::), where no one address can be picked for
    the others. A plain ``http://`` URL only for an agent serving plain HTTP (``--insecure-http``)."""
    from capsule.hosts import check_url

    if given is not None:
        try:
            url = check_url(given)
        except InvalidName as exc:
            raise InvalidName(f"--public-url: {exc}; give the URL other hosts reach this agent at, e.g. "
                              "https://host.example:7070") from None
        if _every_address(urlsplit(url).hostname or ""):
            raise InvalidName(f"--public-url {url}: that is every address of this machine, not one other hosts "
                              "can reach it at: give its name or address, e.g. https://host.example:7070")
        if url.startswith("http://") and scheme == "https":
            raise InvalidName(f"--public-url {url} is plain HTTP, but this agent serves TLS: give its https:// "
                              "URL (the token and the disks must not cross the network in clear)")
        return url
    host, port = parse_listen(listen)
    if _every_address(host):
        return None
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def trusted_proxies(value: str | None) -> list[str]:
    """The addresses ``--trust-proxy ADDR[,ADDR…]`` names (IP addresses or networks, e.g. 127.0.0.1 or
    10.0.0.0/24): only from these are X-Forwarded-For/-Proto believed. Empty: none (the default)."""
    if value is None:
        return []
    out = []
    for item in value.split(","):
        item = item.strip()
        try:
            out.append(str(ipaddress.ip_network(item) if "/" in item else ipaddress.ip_address(item)))
        except ValueError:
            raise InvalidName(f"--trust-proxy {value!r}: {item!r} is not an IP address or network (give the "
                              "reverse proxies' addresses, e.g. 127.0.0.1 or 10.0.0.0/24, comma-separated; "
                              "names and * are not taken)") from None
    return out


def serve(home: Path, listen: str, token_file: Path, ident: Identity | None = None,
          limits: Limits | None = None, *, public: str | None = None, trust_proxy: list[str] | None = None) -> None:
    """Run the agent until it is stopped: ``public`` (``--public-url``) is the URL other hosts reach it at,
    by default what it listens on (:func:`public_url`), ``trust_proxy`` the
    addresses whose X-Forwarded-For/-Proto headers are believed (none by default: the connection's own
    address and scheme count). An agent serving plain HTTP may also send tokens over plain HTTP
    (:mod:`hashcache.transport.plain`)."""
    import uvicorn

    from capsule.agent.app import create_app
    from capsule.agent.limits import BodyLimit, guarded_protocols

    host, port = parse_listen(listen)
    ident = ident or identity(home, listen)
    public = public_url(ident.scheme, listen, public)
    if ident.cert is None:      # --insecure-http: this side is configured for plain HTTP, its disk servers too
        plain.allow()
    limits = limits or Limits()
    app = create_app(home, ensure_token(token_file), limits)
    app.state.tls_fingerprint = ident.fingerprint  # what peers pin for this agent (dashboard migrations)
    app.state.public_url = public                  # what they reach it at: configured, never from a request
    from capsule.backup.scheduler import start_in_serve
    start_in_serve(home)  # scheduled backups run inside the agent (capsule/backup/scheduler.py)
    from capsule.lifecycle import localizer
    localizer.start_in_serve(home)  # complete remote layers become local (capsule/lifecycle/localizer.py)
    from capsule.exchange import stranded
    stranded.start_in_serve(home)   # an incoming post-copy whose link never returned goes (exchange/stranded.py)
    http_protocol, ws_protocol = guarded_protocols(limits)  # per-client connections, slow headers, WS messages
    uvicorn.run(BodyLimit(app, limits.max_body), host=host, port=port,
                log_level=os.environ.get("CAPSULE_LOG_LEVEL", "warning"),
                access_log=False, server_header=False, date_header=False,
                # idle: once the last answer has left (limits.py); uvicorn says int, but it is a timer's delay
                timeout_keep_alive=limits.keep_alive,  # type: ignore[arg-type]
                http=http_protocol, ws=ws_protocol, ws_max_size=limits.ws_max_message,
                # X-Forwarded-* only from the configured proxies (uvicorn would believe them from 127.0.0.1)
                proxy_headers=bool(trust_proxy), forwarded_allow_ips=trust_proxy or None,
                ssl_certfile=str(ident.cert) if ident.cert else None,
                ssl_keyfile=str(ident.key) if ident.key else None)
