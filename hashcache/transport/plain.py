"""Plain HTTP to another host: a bearer token sent over ``http://`` crosses the network readable by anyone on
the path. A client sends one over plain HTTP only to a loopback address (127.0.0.0/8, ``::1``, ``localhost``),
unless this process was configured for it: ``capsule --insecure-http …`` for the command line, or
``capsule serve --insecure-http`` for an agent (which can only listen on loopback itself). Either sets
``CAPSULE_INSECURE_HTTP=1`` in this process's environment, so that what it starts (disk servers, the
watcher) follows the same rule.

:func:`check` is made where a transport opens connections of its own (:class:`~hashcache.transport.HttpTransport`,
the block stream's sockets), before any: it looks at the URL only and never resolves a name."""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from hashcache.errors import InsecureTransport

ENV = "CAPSULE_INSECURE_HTTP"
_YES = frozenset({"1", "true", "yes", "on"})


def allow() -> None:
    """Configure this process (and the processes it starts from now on) to send tokens over plain HTTP."""
    os.environ[ENV] = "1"


def allowed() -> bool:
    """Whether this process was configured to send tokens over plain HTTP off loopback."""
    return os.environ.get(ENV, "").strip().lower() in _YES


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) only reaches this machine. A name is never resolved:
    any other name is not loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check(url: str) -> None:
    """Refuse (:class:`InsecureTransport`) to send a token to ``url`` when it is not https and its host is
    not loopback, unless this process was configured insecure (:func:`allowed`)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        host, parts = "", None
    if parts is not None and parts.scheme.lower() in ("https", "wss"):
        return
    if is_loopback(host) or allowed():
        return
    raise InsecureTransport(
        f"refused to send a token to {url} over plain HTTP: it would cross the network readable by anyone on "
        "the path, and nothing was sent. Use the agent's https:// URL (an agent off loopback serves TLS), or, "
        "only if both hosts were deliberately set up without TLS, configure this side with --insecure-http "
        "(`capsule --insecure-http …`, or the agent started with `capsule serve --insecure-http`)")
