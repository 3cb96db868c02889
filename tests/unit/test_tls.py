"""TLS with pinned host keys: the host's key and certificate (made once, 0600, kept), fingerprints, plain
HTTP refused off loopback, the user's own (CA-signed) pair, `host add` pinning (trust on first use, an
explicit --fingerprint, a CA), and a host whose key changed after `host add` refused by every client path
with ssh's warning."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import stat

import pytest
from typer.testing import CliRunner

from capsule import capsules, hosts, transfer
from capsule.agent.serve import identity, is_loopback
from capsule.agentclient import AgentClient
from capsule.backup.retention import Policy
from capsule.errors import InvalidName
from capsule.store import Store
from diskserver.chain.spec import ChainSpec, LayerSpec, RemoteSpec, SpecError
from diskserver.errors import SourceError
from diskserver.source import HcpSource
from hashcache.errors import HostKeyError, InvalidInput
from hashcache.transport import Call, HttpTransport, tls
from tests.helpers.inprocess_agent import InProcessAgent
from tests.unit.test_dashboard_api import _fake_image

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN_A = "a-token-of-host-a-0123456789"
TOKEN_B = "b-token-of-host-b-0123456789"
CHANGED = "REMOTE HOST IDENTIFICATION HAS CHANGED"


def cli(*args: str, input: str | None = None) -> tuple[int, str]:  # noqa: A002 - CliRunner's name
    """``capsule ARGS`` in-process: its exit code and what it printed, as ``main`` maps errors."""
    from capsule.cli.common import exit_code_for
    from capsule.cli.main import app

    r = CliRunner().invoke(app, list(args), input=input)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return exit_code_for(r.exception), r.output + str(r.exception)
    return r.exit_code, r.output


# -- the host's key and certificate ----------------------------------------------------------------------

def test_the_host_key_is_made_once_private_and_kept(tmp_path):
    first = tls.ensure_host_cert(tmp_path / "tls")
    assert first.created
    assert stat.S_IMODE(first.key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    assert first.fingerprint == tls.fingerprint(ssl.PEM_cert_to_DER_cert(first.cert.read_text()))
    key_pem = first.key.read_bytes()
    again = tls.ensure_host_cert(tmp_path / "tls")  # a restart
    assert not again.created and again.fingerprint == first.fingerprint and again.key.read_bytes() == key_pem
    other = tls.ensure_host_cert(tmp_path / "other")
    assert other.fingerprint != first.fingerprint


def test_the_certificate_names_the_host_and_loopback(tmp_path):
    from cryptography import x509

    made = tls.ensure_host_cert(tmp_path, hostname="deskhost")
    cert = x509.load_pem_x509_certificate(made.cert.read_bytes())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(alt.get_values_for_type(x509.DNSName)) == {"deskhost", "localhost"}
    assert ipaddress.ip_address("127.0.0.1") in alt.get_values_for_type(x509.IPAddress)
    assert cert.issuer == cert.subject  # self-signed
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=3000)


def test_a_key_without_its_certificate_is_not_silently_replaced(tmp_path):
    made = tls.ensure_host_cert(tmp_path)
    made.cert.unlink()
    with pytest.raises(InvalidInput, match="exists without its pair"):
        tls.ensure_host_cert(tmp_path)
    assert made.key.exists()


@pytest.mark.parametrize(("text", "ok"), [
    ("SHA256:" + "A" * 43, True), ("SHA256:" + "A" * 43 + "=", True), ("ab" * 32, True),
    (":".join(["AB"] * 32), True), ("SHA256:" + "A" * 42, False), ("MD5:aa", False), ("", False),
    ("SHA256:" + "A" * 42 + "!", False)])
def test_fingerprints_are_parsed_in_ssh_and_hex_forms(text, ok):
    if ok:
        assert tls.parse_fingerprint(text).startswith("SHA256:") and len(tls.parse_fingerprint(text)) == 50
    else:
        with pytest.raises(InvalidInput, match="invalid fingerprint"):
            tls.parse_fingerprint(text)
    assert tls.parse_fingerprint("ab" * 32) == tls.parse_fingerprint(":".join(["AB"] * 32))


# -- capsule serve: TLS by default, plain HTTP on loopback only ------------------------------------------

@pytest.mark.parametrize("listen", ["0.0.0.0:7070", "[::]:7070", "192.0.2.7:7070", "example.org:7070"])
def test_insecure_http_is_refused_off_loopback(tmp_path, listen):
    with pytest.raises(InvalidName, match="--insecure-http is refused"):
        identity(tmp_path, listen, insecure_http=True)
    assert not (tmp_path / "tls").exists()


def test_insecure_http_on_loopback_and_tls_by_default(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    plain = identity(tmp_path, "127.0.0.1:7070", insecure_http=True)
    assert plain.scheme == "http" and plain.fingerprint is None
    own = identity(tmp_path, "0.0.0.0:7070")
    assert own.scheme == "https" and own.created and own.cert == tmp_path / "tls" / "host.crt"
    assert identity(tmp_path, "0.0.0.0:7070").fingerprint == own.fingerprint  # kept across restarts


def test_serve_refuses_insecure_http_off_loopback_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HOME", str(tmp_path / "s"))
    code, out = cli("serve", "--listen", "0.0.0.0:7070", "--insecure-http")
    assert code == 2 and "--insecure-http is refused on 0.0.0.0" in out


def _ca_pair(tmp_path):
    """A test CA and a server certificate it signed for 127.0.0.1: (CA file, cert file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "host")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(pem))
    (tmp_path / "host.crt").write_bytes(leaf.public_bytes(pem))
    (tmp_path / "host.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return tmp_path / "ca.crt", tmp_path / "host.crt", tmp_path / "host.key"


def test_a_users_ca_signed_certificate_is_served_and_checked_against_the_ca(tmp_path, monkeypatch):
    ca, cert, key = _ca_pair(tmp_path / "ca")
    ident = identity(tmp_path / "b", "0.0.0.0:7070", cert=cert, key=key)
    assert ident.cert == cert and ident.fingerprint == tls.cert_fingerprint(cert)
    assert not (tmp_path / "b" / "tls").exists()  # no host key made
    with pytest.raises(InvalidInput, match="cannot use the certificate"):
        identity(tmp_path / "b", "0.0.0.0:7070", cert=cert, key=tls.ensure_host_cert(tmp_path / "x").key)
    with pytest.raises(InvalidName, match="go together"):
        identity(tmp_path / "b", "0.0.0.0:7070", cert=cert)
    peer = InProcessAgent(tmp_path / "b", TOKEN_B, tls_dir=tmp_path / "ca")  # serves host.crt/host.key there
    try:
        with pytest.raises(HostKeyError, match="cannot trust"):  # the test CA is not trusted yet
            HttpTransport(peer.url, TOKEN_B).call(Call.get("/v1/info"))
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        assert HttpTransport(peer.url, TOKEN_B).call(Call.get("/v1/info")).status == 200  # no pin: the CA
        store = Store.open(tmp_path / "a")
        seen = []
        added = hosts.add(store, "b", peer.url, TOKEN_B, confirm=lambda c: seen.append(c) or True)
        assert seen[0].ca_signed and seen[0].fingerprint == ident.fingerprint
        assert added.fingerprint is None  # CA-validated, not pinned
        hosts.remove(store, "b")
        assert hosts.add(store, "b", peer.url, TOKEN_B).fingerprint is None  # no question needed for a CA
        assert [s.reachable for s in hosts.ask_all(store)] == [True]
        store.close()
    finally:
        peer.stop()


# -- host add pins; a changed key is refused everywhere ----------------------------------------------------

@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "a")
    yield s
    s.close()


@pytest.fixture
def peer(tmp_path):
    agent = InProcessAgent(tmp_path / "b", TOKEN_B, tls_dir=tmp_path / "b-tls")
    yield agent
    agent.stop()


def test_host_add_shows_and_pins_the_fingerprint(store, peer):
    shown = []
    added = hosts.add(store, "b", peer.url, TOKEN_B, confirm=lambda c: shown.append(c) or True)
    assert [c.fingerprint for c in shown] == [peer.fingerprint] and not shown[0].ca_signed
    assert added.fingerprint == peer.fingerprint == hosts.get(store, "b").fingerprint
    assert hosts.pin_for(store, peer.url) == peer.fingerprint
    assert hosts.pin_for(store, peer.url, "ab" * 32) == tls.parse_fingerprint("ab" * 32)  # explicit wins


def test_host_add_refused_when_not_confirmed_or_the_fingerprint_differs(store, peer):
    with pytest.raises(HostKeyError, match=f"self-signed certificate, {re.escape(peer.fingerprint)}.*--fingerprint"):
        hosts.add(store, "b", peer.url, TOKEN_B)  # a library caller that neither asks nor knows: no TOFU
    with pytest.raises(HostKeyError, match="was not accepted; nothing was added"):
        hosts.add(store, "b", peer.url, TOKEN_B, confirm=lambda _c: False)
    wrong = "SHA256:" + "B" * 43
    with pytest.raises(HostKeyError, match=CHANGED) as exc:
        hosts.add(store, "b", peer.url, TOKEN_B, fingerprint=wrong, confirm=lambda _c: pytest.fail("asked"))
    assert wrong in str(exc.value) and peer.fingerprint in str(exc.value)
    assert hosts.peers(store) == []
    added = hosts.add(store, "b", peer.url, TOKEN_B, fingerprint=peer.fingerprint,
                      confirm=lambda _c: pytest.fail("asked although the fingerprint was given"))
    assert added.fingerprint == peer.fingerprint


def test_host_add_on_the_command_line(store, peer, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HOME", str(store.home))
    monkeypatch.setenv("CAPSULE_TOKEN", TOKEN_B)
    code, out = cli("host", "add", "b", peer.url, "--json")  # nobody to ask, nothing given
    assert code == 2 and "--fingerprint" in out and hosts.peers(store) == []
    code, out = cli("host", "add", "b", peer.url, "--fingerprint", "SHA256:" + "D" * 43)
    assert code == HostKeyError.exit_code and CHANGED in out and hosts.peers(store) == []
    code, out = cli("host", "add", "b", peer.url, "--fingerprint", peer.fingerprint, "--json")
    assert code == 0, out
    assert json.loads(out)["fingerprint"] == peer.fingerprint
    hosts.remove(store, "b")
    code, out = cli("host", "add", "b", peer.url, "--yes")  # trust on first use, said so: shown, then pinned
    assert code == 0, out
    assert f"Its certificate fingerprint is {peer.fingerprint}." in out and f"certificate {peer.fingerprint})" in out
    assert hosts.get(store, "b").fingerprint == peer.fingerprint
    code, out = cli("host", "ls", "--json")
    assert code == 0 and [r["fingerprint"] for r in json.loads(out)] == [peer.fingerprint]


def _new_key_at_the_same_place(tmp_path, peer: InProcessAgent) -> InProcessAgent:
    """The peer restarted on its port with another host key (a new store, or someone in the middle)."""
    peer.stop()
    return InProcessAgent(tmp_path / "b", TOKEN_B, tls_dir=tmp_path / "b-new-tls", port=peer.port)


def test_a_changed_host_key_is_refused_by_every_client_path(store, peer, tmp_path):
    """After `host add`, the peer comes back at its URL with another key: push, pull and run (the pin found by
    URL), host ls / the dashboard's peers, the console relay, the fleet, backup verify and the disk server's
    source (stream and HTTP) all refuse it with ssh's warning naming both fingerprints; rm + add fixes it."""
    from capsule.backup import copies, verifyjob
    from capsule.console import relay
    from capsule.fleet import hostops, members

    pinned = hosts.add(store, "b", peer.url, TOKEN_B, confirm=lambda _c: True).fingerprint
    moved = _new_key_at_the_same_place(tmp_path, peer)
    try:
        assert moved.fingerprint != pinned

        def refused(fn, *args, **kw):
            with pytest.raises(HostKeyError, match=CHANGED) as exc:
                fn(*args, **kw)
            assert pinned in str(exc.value) and moved.fingerprint in str(exc.value)
            assert "capsule host rm" in str(exc.value)

        # transfers find the known host's pin by its URL
        _fake_image(store)
        capsules.create(store, "desk", "img", memory="256M")
        refused(transfer.push, store, "desk@1", moved.url, TOKEN_B)
        refused(transfer.pull, store, moved.url, "cap@1", TOKEN_B)
        refused(transfer.run, store, moved.url, "cap@1", TOKEN_B)
        # the peer's own calls: ask_all (host ls, dashboard), console relay, backup verify, fleet
        [status] = hosts.ask_all(store, timeout=10)
        assert not status.reachable and status.error_code == "host_key" and CHANGED in status.error
        peer_row = hosts.get(store, "b")
        refused(relay._peer_ticket, peer_row, "cap", "screen")  # noqa: SLF001
        refused(lambda: AgentClient(peer_row.url, peer_row.token, fingerprint=peer_row.fingerprint)
                .get_json("/v1/info"))
        refused(hostops.activity, members.Member(peer_row, "default", 0.0, None))
        store.catalogue.query(  # a copy recorded as made before the key changed
            "INSERT INTO backup_copies(capsule, number, target, copied, wire_bytes) VALUES('desk', 1, 'b', 0, 0)")
        [_here, there] = verifyjob.run(store, ["desk"]).hosts
        assert there.host == "b" and CHANGED in there.error and pinned in there.error
        refused(copies.prune_there, store, "desk", "b", Policy(last=1))
        # demand paging's source (the disk server), over the block stream and over HTTP
        token_file = tmp_path / "tok"
        token_file.write_text(TOKEN_B)
        for stream in (True, False):
            src = HcpSource(moved.url, token_file, fingerprint=pinned, stream=stream, retry_seconds=2)
            with pytest.raises(SourceError, match=CHANGED):
                src.read_blocks("ab" * 32, [0])
            src.close()
        # with the right pin (after `host rm` + `host add`, or --fingerprint) all is well again
        hosts.remove(store, "b")
        assert hosts.add(store, "b", moved.url, TOKEN_B, fingerprint=moved.fingerprint).fingerprint \
            == moved.fingerprint
        assert [s.reachable for s in hosts.ask_all(store, timeout=10)] == [True]
        src = HcpSource(moved.url, token_file, fingerprint=moved.fingerprint, retry_seconds=2)
        with pytest.raises(SourceError, match="no layer"):  # an answer: it got through
            src.read_blocks("ab" * 32, [0])
        src.close()
    finally:
        moved.stop()


def test_the_cli_refuses_a_changed_key(store, peer, tmp_path, monkeypatch):
    hosts.add(store, "b", peer.url, TOKEN_B, fingerprint=peer.fingerprint)
    moved = _new_key_at_the_same_place(tmp_path, peer)
    try:
        monkeypatch.setenv("CAPSULE_HOME", str(store.home))
        monkeypatch.setenv("CAPSULE_TOKEN", TOKEN_B)
        for args in (["pull", "cap@1", "--from", moved.url], ["start", "cap@1", "--from", moved.url]):
            code, out = cli(*args)
            assert code == HostKeyError.exit_code and CHANGED in out, out
        # an explicit --fingerprint (a script that checked it) is used instead of the stale pin
        code, out = cli("pull", "cap@1", "--from", moved.url, "--fingerprint", moved.fingerprint)
        assert code == 3 and CHANGED not in out, out  # it got through: no such capsule there
    finally:
        moved.stop()


def test_a_remote_layer_spec_carries_its_pin(tmp_path):
    """The disk server's chain spec keeps a remote layer's pin through its JSON form, and refuses a bad one."""
    pin = "SHA256:" + "C" * 43
    remote = {"url": "https://127.0.0.1:1", "token_file": str(tmp_path / "t"), "fingerprint": pin}
    layer = {"id": "ab" * 32, "manifest_path": str(tmp_path / "m"), "remote": remote}
    with pytest.raises(SpecError) as exc:  # the manifest file is missing; the pin was read before that
        ChainSpec.from_dict({"version": 1, "layers": [layer]})
    assert "fingerprint" not in str(exc.value)
    for bad in (5, "SHA256:short"):
        with pytest.raises(SpecError, match="fingerprint"):
            ChainSpec.from_dict({"version": 1, "layers": [dict(layer, remote=dict(remote, fingerprint=bad))]})
    assert RemoteSpec(remote["url"], remote["token_file"], pin) == RemoteSpec(**remote)
    assert LayerSpec(id=layer["id"], manifest_path=layer["manifest_path"], remote=RemoteSpec(**remote)).remote


def test_the_dashboard_is_served_over_the_same_tls_listener_with_a_secure_cookie(peer, tmp_path):
    """The page and its API on the agent's TLS port; the session cookie is marked Secure there, and a plain
    HTTP request to the TLS port gets no page."""
    import httpx

    with httpx.Client(base_url=peer.url, verify=tls.client_context(peer.fingerprint), timeout=10) as client:
        assert client.get("/").status_code == 200
        r = client.post("/api/session", json={"token": TOKEN_B})
        assert r.status_code == 200
        cookie = r.headers["set-cookie"]
        assert "secure" in cookie.lower() and "httponly" in cookie.lower()
    with pytest.raises(httpx.TransportError):
        httpx.get(peer.url.replace("https://", "http://") + "/", timeout=5)


def test_asyncio_connections_check_the_pin_too(peer):
    """websockets' client (the console relay) runs TLS on asyncio's SSLObject: the same pin check."""
    import asyncio

    async def connect(pin: str) -> None:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", peer.port, ssl=tls.client_context(pin)), 10)
        writer.close()

    asyncio.run(connect(peer.fingerprint))
    with pytest.raises(tls.PinMismatch) as exc:
        asyncio.run(connect("SHA256:" + "E" * 43))
    assert exc.value.actual == peer.fingerprint
