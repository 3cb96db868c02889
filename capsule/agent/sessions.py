"""Dashboard sign-in: short-lived sessions and their CSRF tokens.

Signing in with the host's token makes a session: a random id in a cookie (HttpOnly, SameSite=Strict,
Secure over https) and a CSRF token the page sends back in the ``X-CSRF-Token`` header with every
state-changing request (the page gets it from the sign-in answer or from ``GET /api/session``, which a
page of another origin cannot read). Sessions live in this agent process's memory: restarting the agent
signs everyone out. A session ends after ``idle`` seconds without a request, and ``lifetime`` seconds
after sign-in in any case.

Sign-in is with a user name and password (``capsule user add``), or with the host's token while no admin user
exists; the session carries the :class:`Principal` it acts as. Failed sign-ins are bounded per client address and
per user name (:class:`Attempts`: ``MAX_FAILURES`` a minute, then 429 with ``Retry-After``).

Scripts send ``Authorization: Bearer TOKEN`` instead (a browser never adds that header by itself, so
those requests need no CSRF token). Checking either is :mod:`capsule.agent.authz`'s job, before any route."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request

from capsule.accounts.model import Principal, legacy_principal
from capsule.errors import TooManyAttempts

IDLE = 30 * 60.0
LIFETIME = 12 * 3600.0
MAX_SESSIONS = 256
CSRF_HEADER = "x-csrf-token"
UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_FAILURES = 5        # failed sign-ins per WINDOW seconds, per client address and per user name
WINDOW = 60.0


def unauthorized() -> HTTPException:
    """The one answer to a request without a valid session or token: it says nothing about the host."""
    return HTTPException(status_code=401, detail="sign in first (or send the host's token as a bearer token)",
                         headers={"WWW-Authenticate": "Bearer"})


def forbidden(why: str) -> HTTPException:
    return HTTPException(status_code=403, detail=why)


@dataclass
class Session:
    sid: str
    csrf: str
    created: float
    seen: float
    principal: Principal

    def expires(self, idle: float, lifetime: float) -> float:
        return min(self.seen + idle, self.created + lifetime)


@dataclass
class Caller:
    """Who made a request: a signed-in page (with its session) or a script with a bearer token, and the principal
    it acts as."""

    session: Session | None
    principal: Principal

    @property
    def bearer(self) -> bool:
        return self.session is None


class Sessions:
    """Sessions of one agent, in memory. ``clock`` is replaceable (tests)."""

    def __init__(self, token: str, store_id: str, *, idle: float = IDLE, lifetime: float = LIFETIME,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._token = token.encode()
        self.idle = idle
        self.lifetime = lifetime
        self.clock = clock
        # two agents on one machine share the browser's cookies for 127.0.0.1: one name per store
        self.cookie = f"capsule_session_{store_id}"
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    # -- sign-in / sign-out ------------------------------------------------------------------------
    def check_token(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self._token)

    def create(self, principal: Principal | None = None) -> Session:
        now = self.clock()
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now, now, principal or legacy_principal())
        with self._lock:
            self._by_id[s.sid] = s
            while len(self._by_id) > MAX_SESSIONS:
                self._by_id.popitem(last=False)
        return s

    def end(self, session: Session) -> None:
        with self._lock:
            self._by_id.pop(session.sid, None)

    def expires_in(self, session: Session) -> float:
        return max(0.0, session.expires(self.idle, self.lifetime) - self.clock())

    def lookup(self, sid: str | None) -> Session | None:
        """The live session with this id (its idle timer restarted), or None."""
        if not sid:
            return None
        now = self.clock()
        with self._lock:
            s = self._by_id.get(sid)
            if s is None:
                return None
            if now >= s.expires(self.idle, self.lifetime):
                del self._by_id[sid]
                return None
            s.seen = now
            self._by_id.move_to_end(sid)
            return s

    # -- per request -------------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Caller:
        """Who the guard (:mod:`capsule.agent.authz`) found this request to come from; 401 without one."""
        caller = request.scope.get("state", {}).get("caller")
        if caller is None:
            raise unauthorized()
        return caller


class Attempts:
    """Failed sign-ins, bounded: at most ``limit`` per ``window`` seconds per key (a client address, a user
    name); over it, :class:`TooManyAttempts` until the oldest failure leaves the window."""

    def __init__(self, limit: int = MAX_FAILURES, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        self._lock = threading.Lock()
        self._failures: dict[str, deque[float]] = {}

    def check(self, *keys: str) -> None:
        now = self.clock()
        with self._lock:
            for key in keys:
                q = self._failures.get(key)
                while q and q[0] <= now - self.window:
                    q.popleft()
                if q is not None and not q:
                    del self._failures[key]
                elif q is not None and len(q) >= self.limit:
                    wait = max(1, int(q[0] + self.window - now + 0.999))
                    raise TooManyAttempts(f"too many failed sign-ins for {key.split(':', 1)[0]} "
                                          f"({self.limit} in {self.window:.0f} s): try again in {wait} s",
                                          retry_after=wait)

    def failed(self, *keys: str) -> None:
        now = self.clock()
        with self._lock:
            if len(self._failures) > 10_000:      # a flood of made-up names must not grow this without end
                self._failures.clear()
            for key in keys:
                self._failures.setdefault(key, deque()).append(now)


def check_same_origin(request: Request) -> None:
    """Refuse a request a browser marks as coming from another site (Origin / Sec-Fetch-Site)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise forbidden("cross-site request refused")
    origin = request.headers.get("origin")
    if origin is not None and origin != own_origin(request):
        raise forbidden("cross-site request refused")


def own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}"
