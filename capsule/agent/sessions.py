"""Dashboard sign-in: short-lived sessions and their CSRF tokens.

Signing in with the host's token makes a session: a random id in a cookie (HttpOnly, SameSite=Strict,
Secure over https) and a CSRF token the page sends back in the ``X-CSRF-Token`` header with every
state-changing request (the page gets it from the sign-in answer or from ``GET /api/session``, which a
page of another origin cannot read). Sessions live in this agent process's memory: restarting the agent
signs everyone out. A session ends after ``idle`` seconds without a request, ``lifetime`` seconds after
sign-in in any case, and at its next request once its user's password changed (``live``, however it was changed:
``capsule user passwd`` while the agent runs included). The cookie is named for the store
(``capsule_session_<store id>``): another agent, or another service on the same host name, does not get it.

Sign-in is with a user name and password (``capsule user add``), or with the host's token while no admin user
exists; the session carries the :class:`Principal` it acts as. Failed sign-ins are bounded per client address and
per user name (:class:`Attempts`: ``MAX_FAILURES`` a minute, then 429 with ``Retry-After``), checked before any
password is hashed (:mod:`capsule.agent.signin`).

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
MAX_KEYS = 10_000       # addresses and user names followed at once


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
    stamp: str | None = None     # the user's password as of sign-in (users.password_stamp): a change ends it

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
                 clock: Callable[[], float] = time.monotonic, live: Callable[[Session], bool] | None = None) -> None:
        self._token = token.encode()
        self.live = live            # whether a session still stands (its user's password unchanged); None: all
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

    def create(self, principal: Principal | None = None, stamp: str | None = None) -> Session:
        now = self.clock()
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now, now, principal or legacy_principal(),
                    stamp)
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
        """The live session with this id (its idle timer restarted), or None: also once its user's password
        changed, wherever it was changed (``live`` reads the catalogue: call this in a thread)."""
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
        if self.live is not None and not self.live(s):
            self.end(s)
            return None
        with self._lock:
            if sid not in self._by_id:
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
    name); over it, :class:`TooManyAttempts` until the oldest failure leaves the window. A sign-in under way
    counts as a failure until it is known (:meth:`begin`, :meth:`done`), so a burst of them at once cannot pass
    the check together.

    At most ``max_keys`` keys are followed; past that, keys whose failures have all left the window go first, then
    the least recently tried keys still under the limit, and only then others — never all at once, so a flood of
    made-up names or addresses does not lift the limit of a key that is over it."""

    def __init__(self, limit: int = MAX_FAILURES, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.limit, self.window, self.clock, self.max_keys = limit, window, clock, max_keys
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()    # least recently tried first
        self._pending: dict[str, int] = {}

    def check(self, *keys: str) -> None:
        """Refuse (:class:`TooManyAttempts`) when any key is at its limit."""
        with self._lock:
            self._check(self.clock(), keys)

    def begin(self, *keys: str) -> None:
        """:meth:`check`, then count this attempt against ``keys`` until :meth:`done`."""
        with self._lock:
            self._check(self.clock(), keys)
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1

    def done(self, *keys: str, failed: bool) -> None:
        """The attempt :meth:`begin` counted ended; ``failed``: it stays counted, as a failure."""
        with self._lock:
            for key in keys:
                n = self._pending.get(key, 0) - 1
                if n > 0:
                    self._pending[key] = n
                else:
                    self._pending.pop(key, None)
        if failed:
            self.failed(*keys)

    def failed(self, *keys: str) -> None:
        now = self.clock()
        with self._lock:
            for key in keys:
                self._failures.setdefault(key, deque()).append(now)
                self._failures.move_to_end(key)
                q = self._failures[key]
                while len(q) > self.limit:
                    q.popleft()
            if len(self._failures) > self.max_keys:
                self._evict(now)

    def _check(self, now: float, keys: tuple[str, ...]) -> None:
        for key in keys:
            q = self._failures.get(key)
            while q and q[0] <= now - self.window:
                q.popleft()
            if q is not None and not q:
                del self._failures[key]
                q = None
            failures = len(q) if q else 0
            if failures + self._pending.get(key, 0) >= self.limit:
                if q:
                    self._failures.move_to_end(key)      # tried again: kept the longest
                # (at the limit only with sign-ins under way: they end within a second or so)
                wait = max(1, int(q[0] + self.window - now + 0.999)) if q and failures >= self.limit else 1
                raise TooManyAttempts(f"too many failed sign-ins for {key.split(':', 1)[0]} "
                                      f"({self.limit} in {self.window:.0f} s): try again in {wait} s",
                                      retry_after=wait)

    def _evict(self, now: float) -> None:
        """Down to 9/10 of ``max_keys``: the expired first, then the least recently tried under the limit, then
        the least recently tried (the caller holds the lock)."""
        goal = self.max_keys * 9 // 10
        for drop in (lambda q: not q or q[-1] <= now - self.window, lambda q: len(q) < self.limit,
                     lambda q: True):
            for key in [k for k, q in self._failures.items() if drop(q)]:
                if len(self._failures) <= goal:
                    return
                del self._failures[key]


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
