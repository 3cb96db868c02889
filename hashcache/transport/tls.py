"""TLS material and trust, in one place: the host's key and self-signed certificate (made once, kept), the
certificate fingerprint (``SHA256:`` + unpadded base64 of the DER certificate's SHA-256, as ssh prints host
keys), and the one client :class:`ssl.SSLContext` every transport uses.

Trust, the way ssh and Syncthing do it: a peer is *pinned* by its certificate's fingerprint. With a pin the
context skips CA validation and checks, right after the handshake and before a byte of the request (the
token) is sent, that the peer's certificate has exactly that fingerprint; another one is refused with
:class:`PinMismatch` (a :class:`ssl.SSLCertVerificationError`). Without a pin the system's CA validation and
host name check apply (a host with a CA-signed certificate of its own). The check sits in the context's
socket and object classes, so httpx, the block stream's plain socket and asyncio (websockets) all run it.

:func:`explain` turns such a failure into :class:`~hashcache.errors.HostKeyError` with ssh's warning.
The key pair is made with the ``cryptography`` package (imported only when one is made).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import ipaddress
import os
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hashcache.errors import HostKeyError, InvalidInput

CERT_NAME = "host.crt"
KEY_NAME = "host.key"
VALID_DAYS = 3650
_FP = re.compile(r"SHA256:([A-Za-z0-9+/]{43})=?")


# -- fingerprints -----------------------------------------------------------------------------------

def fingerprint(der: bytes) -> str:
    """``SHA256:…`` of a DER certificate (what `capsule host add` shows and stores)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode().rstrip("=")


def parse_fingerprint(text: str) -> str:
    """A fingerprint as given by a user: ``SHA256:`` + base64 (ssh's form) or 64 hex digits (colons
    allowed, as openssl prints them); returned in the ``SHA256:`` form."""
    s = (text or "").strip()
    if m := _FP.fullmatch(s):
        return "SHA256:" + m.group(1)
    hexdigits = s.removeprefix("SHA256:").removeprefix("sha256:").replace(":", "")
    if re.fullmatch(r"[0-9A-Fa-f]{64}", hexdigits):
        return "SHA256:" + base64.b64encode(binascii.unhexlify(hexdigits)).decode().rstrip("=")
    raise InvalidInput(f"invalid fingerprint {text[:100]!r}: expected SHA256: and 43 base64 characters, "
                       "as `capsule host add` and `capsule serve` print it")


def cert_fingerprint(cert_file: Path) -> str:
    """The fingerprint of a PEM certificate file."""
    return fingerprint(ssl.PEM_cert_to_DER_cert(Path(cert_file).read_text()))


# -- the host's key and certificate -------------------------------------------------------------------

@dataclass(frozen=True)
class HostCert:
    cert: Path
    key: Path
    fingerprint: str
    created: bool = False   # made just now


def ensure_host_cert(directory: Path, *, hostname: str | None = None) -> HostCert:
    """The host's certificate and key in ``directory`` (``host.crt``, ``host.key`` mode 0600), made on first
    use: an EC P-256 key and a self-signed certificate for the host's name, ``localhost`` and the loopback
    addresses, valid ten years. Kept as they are afterwards: the fingerprint peers pinned stays valid."""
    directory = Path(directory)
    cert, key = directory / CERT_NAME, directory / KEY_NAME
    if cert.exists() and key.exists():
        return HostCert(cert, key, cert_fingerprint(cert))
    if cert.exists() != key.exists():
        have = cert if cert.exists() else key
        raise InvalidInput(f"{have} exists without its pair ({key if have == cert else cert}): restore it, or "
                           "remove it to make a new host key (every host that pinned this one must add it again)")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    name = hostname or socket.gethostname() or "localhost"
    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"capsule host {name}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([name, "localhost"])]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                   .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    _write_new(key, key_pem, 0o600)
    _write_new(cert, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
    return HostCert(cert, key, cert_fingerprint(cert), created=True)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` whole (a temporary file with ``mode`` from the start, fsynced, renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def server_fingerprint(cert_file: Path, key_file: Path) -> str:
    """Check that a user's certificate and key belong together (ssl loads them); their fingerprint."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"cannot use the certificate {cert_file} with the key {key_file}: {exc}") from exc
    return cert_fingerprint(cert_file)


# -- the client side: one context, pinned or CA-validated ------------------------------------------------

class PinMismatch(ssl.SSLCertVerificationError):
    """The peer's certificate is not the pinned one."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"certificate fingerprint {actual} is not the pinned {expected}")
        self.expected, self.actual = expected, actual


def _check_pin(conn: ssl.SSLSocket | ssl.SSLObject) -> None:
    pin = getattr(conn.context, "pin", None)
    if pin is None:
        return
    der = conn.getpeercert(binary_form=True)
    actual = fingerprint(der) if der else "(no certificate)"
    if actual != pin:
        raise PinMismatch(pin, actual)


class _PinnedSocket(ssl.SSLSocket):
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_pin(self)


class _PinnedObject(ssl.SSLObject):
    def do_handshake(self) -> None:
        super().do_handshake()   # asyncio calls it until it stops asking for more data
        _check_pin(self)


class PinnedContext(ssl.SSLContext):
    """A client context that accepts exactly one certificate: the one whose fingerprint is ``pin``."""

    pin: str | None = None
    sslsocket_class = _PinnedSocket
    sslobject_class = _PinnedObject


def client_context(pin: str | None) -> ssl.SSLContext:
    """The context for connecting to an agent: pinned to ``pin`` (``SHA256:…``), or without one the system's
    CA validation with the host name checked."""
    if pin is None:
        return ssl.create_default_context()
    ctx = PinnedContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # replaced by the pin, checked once the handshake is done
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.pin = parse_fingerprint(pin)
    return ctx


def cause(exc: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The certificate failure somewhere in an exception's chain (httpx and websockets wrap it)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def explain(url: str, failure: ssl.SSLCertVerificationError) -> HostKeyError:
    """The error a user reads when ``url``'s certificate is refused: ssh's warning for a changed one, the way
    to pin it for a self-signed one."""
    host = urlsplit(url).netloc or url
    if isinstance(failure, PinMismatch):
        return HostKeyError(
            f"REMOTE HOST IDENTIFICATION HAS CHANGED for {host}! The agent at {url} presents the certificate "
            f"{failure.actual}, but {failure.expected} is pinned for it. Someone could be eavesdropping on you "
            "right now (a man-in-the-middle), or the host's key was replaced (a new store, or a new "
            "--cert/--key). Nothing was sent. If the change is expected, check the fingerprint on that host "
            "(`capsule serve` prints it) and then `capsule host rm NAME` and `capsule host add NAME URL` "
            f"again, or pass --fingerprint {failure.actual} once you have checked it there.")
    return HostKeyError(
        f"cannot trust the agent at {url}: {failure.verify_message or failure.reason or failure}. "
        "A self-signed host is trusted by its fingerprint: `capsule host add NAME URL` shows it and "
        "pins it, or pass --fingerprint SHA256:… (printed by `capsule serve` on that host).")


def peer_certificate(url: str, timeout: float = 10.0) -> tuple[str, bool]:
    """The fingerprint of the certificate the agent at ``https://…`` presents, and whether it is valid
    for that host name under the system's CAs. Nothing is sent but the handshake (for ``host add``)."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise InvalidInput(f"{url} is not an https:// URL")
    addr = (parts.hostname, parts.port or 443)
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    with socket.create_connection(addr, timeout=timeout) as raw, \
            probe.wrap_socket(raw, server_hostname=parts.hostname) as s:
        der = s.getpeercert(binary_form=True)
    if not der:
        raise HostKeyError(f"the agent at {url} presented no certificate")
    try:
        with socket.create_connection(addr, timeout=timeout) as raw, \
                ssl.create_default_context().wrap_socket(raw, server_hostname=parts.hostname):
            ca_signed = True
    except ssl.SSLCertVerificationError:
        ca_signed = False
    return fingerprint(der), ca_signed
