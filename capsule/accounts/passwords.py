"""Password hashing: scrypt (Python's ``hashlib``, i.e. OpenSSL's) with a random salt per password.

A stored hash reads ``scrypt$LOG2N$R$P$SALT$HASH`` (salt and hash in unpadded base64), so the cost can be
raised later and old hashes still verify. Verification compares in constant time; a hash with parameters
outside sane bounds is refused rather than computed (a doctored catalogue must not make sign-in hang)."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import secrets

from capsule.errors import InvalidName

LOG2_N = 15          # N = 32768: ~32 MiB and some tens of ms per hash
R = 8
P = 1
DKLEN = 32
MIN_LENGTH = 8
MAX_LENGTH = 1024


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def _scrypt(password: str, salt: bytes, log2_n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode(), salt=salt, n=1 << log2_n, r=r, p=p, dklen=DKLEN,
                          maxmem=256 * (1 << log2_n) * r + (1 << 20))


def check_password(password: str) -> str:
    if not isinstance(password, str) or not MIN_LENGTH <= len(password) <= MAX_LENGTH:
        raise InvalidName(f"a password must be {MIN_LENGTH} to {MAX_LENGTH} characters long")
    if "\x00" in password:
        raise InvalidName("a password must not contain NUL characters")
    return password


def hash_password(password: str) -> str:
    """The string to store for ``password`` (never the password itself)."""
    check_password(password)
    salt = secrets.token_bytes(16)
    return f"scrypt${LOG2_N}${R}${P}${_b64(salt)}${_b64(_scrypt(password, salt, LOG2_N, R, P))}"


def verify_password(password: str, stored: str) -> bool:
    """Whether ``password`` matches ``stored`` (constant-time compare; malformed hashes never match)."""
    try:
        scheme, log2_n, r, p, salt, digest = stored.split("$")
        n_, r_, p_ = int(log2_n), int(r), int(p)
        if scheme != "scrypt" or not (10 <= n_ <= 20 and 1 <= r_ <= 32 and 1 <= p_ <= 4):
            return False
        expected = _unb64(digest)
        got = _scrypt(password, _unb64(salt), n_, r_, p_)
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


@functools.cache
def dummy_hash() -> str:
    """A hash to spend an unknown user's sign-in on, so timing tells nothing; made on first use (a scrypt at
    import would cost every command, the CLI's included, some hundred milliseconds)."""
    return hash_password("not-a-password-anyone-has")
