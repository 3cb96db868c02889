"""The agent's own public URL is configuration (`capsule serve --public-url`, by default what it listens on), checked
before anything starts; `--trust-proxy` names the only addresses whose X-Forwarded-* headers are believed
(capsule/agent/serve.py). In-process: the command line through its typer app, refusals only (nothing starts)."""

from __future__ import annotations

import pytest

from capsule.agent.serve import public_url, trusted_proxies
from capsule.errors import InvalidName
from tests.unit.test_tls import cli

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_public_url_defaults_to_what_the_agent_listens_on_and_never_to_every_address():
    assert public_url("https", "127.0.0.1:7070") == "https://127.0.0.1:7070"
    assert public_url("https", "[::1]:7070") == "https://[::1]:7070"
    assert public_url("http", "localhost:7171") == "http://localhost:7171"
    assert public_url("https", "work.example:7070") == "https://work.example:7070"
    assert public_url("https", "0.0.0.0:7070") is None and public_url("https", "[::]:7070") is None
    assert public_url("https", "0.0.0.0:7070", "https://work.example:7443/") == "https://work.example:7443"


@pytest.mark.parametrize("url,why", [
    ("ftp://work.example:7070", "expected http://HOST:PORT or https://HOST:PORT"),
    ("https://work.example:7070/agent", "give only scheme, host and port"),
    ("https://user:pw@work.example:7070", "give only scheme, host and port"),
    ("https://work.example:99999", "invalid agent URL"),
    ("work.example:7070", "expected http://HOST:PORT"),
    ("https://0.0.0.0:7070", "every address of this machine"),
    ("http://work.example:7070", "plain HTTP, but this agent serves TLS"),
])
def test_serve_refuses_a_malformed_public_url_before_starting(tmp_path, monkeypatch, url, why):
    monkeypatch.setenv("CAPSULE_HOME", str(tmp_path / "s"))
    code, out = cli("serve", "--listen", "0.0.0.0:7070", "--public-url", url)
    assert code == 2 and "--public-url" in out and why in out and "give" in out, out
    assert not (tmp_path / "s" / "tls").exists()      # no host key made, nothing started
    with pytest.raises(InvalidName, match=why):
        public_url("https", "0.0.0.0:7070", url)


def test_trusted_proxies_are_addresses_or_networks(tmp_path, monkeypatch):
    assert trusted_proxies(None) == []
    assert trusted_proxies("127.0.0.1, 10.0.0.0/24,::1") == ["127.0.0.1", "10.0.0.0/24", "::1"]
    for bad in ("*", "proxy.example", "10.0.0.1/24", "127.0.0.1,", ""):
        with pytest.raises(InvalidName, match="--trust-proxy"):
            trusted_proxies(bad)
    monkeypatch.setenv("CAPSULE_HOME", str(tmp_path / "s"))
    code, out = cli("serve", "--listen", "127.0.0.1:7070", "--insecure-http", "--trust-proxy", "*")
    assert code == 2 and "is not an IP address or network" in out
