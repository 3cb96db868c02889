"""The dashboard in a real browser (Debian's chromium driven by Playwright) against two hosts on this
machine: two stores, two agents on loopback, real guests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsule import capsules, hosts
from testkit.chromium import CHROMIUM

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

SCREENSHOTS = os.environ.get("CAPSULE_SCREENSHOTS")  # a directory to keep the pages' pictures in


def spki_pin(cert_file: Path) -> str:
    """Chromium's pin of a certificate's key: base64 of the SHA-256 of its SubjectPublicKeyInfo."""
    import base64
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = x509.load_pem_x509_certificate(cert_file.read_bytes()).public_key()
    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.fixture
def browser(request):
    """Chromium; when the test's hosts serve TLS, their self-signed certificates are pinned by their keys
    (as a user who compared the fingerprint and accepted it would), nothing else is trusted."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: browser tests drive Debian's chromium (`make setup` installs it)")
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    if "two_hosts" in request.fixturenames:
        agents = request.getfixturevalue("two_hosts")[2:]
        pins = [spki_pin(ag.home / "tls" / "host.crt") for ag in agents if ag.tls]
        if pins:
            args.append("--ignore-certificate-errors-spki-list=" + ",".join(pins))
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        yield b
        b.close()


def _shot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    if SCREENSHOTS:
        page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"), full_page=True)


@pytest.mark.parametrize("two_hosts", [True], ids=["tls"], indirect=True)
def test_sign_in_see_both_hosts_start_a_capsule_and_lose_a_peer(two_hosts, browser, tmp_path):
    """Over TLS: the page at https://, its session cookie Secure, and host A's agent asking host B with B's
    certificate pinned."""
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "desk-a", "tiny", memory="256M")
    capsules.create(b, "desk-b", "tiny", memory="256M")
    hosts.add(a, "home", agent_b.url, agent_b.token, fingerprint=agent_b.fingerprint)
    assert agent_a.url.startswith("https://")

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(agent_a.url)
    expect(page.locator("#sign-in")).to_be_visible()
    expect(page.locator("#hosts")).to_be_hidden()
    assert "desk-a" not in page.content()

    # a wrong token is refused on the page
    page.fill("#token", "not-the-token-0123456789")
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#sign-in-error")).to_contain_text("not this host's token")
    assert "desk-a" not in page.content()

    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    local = page.locator('section[data-host="local"] tr[data-capsule="desk-a"]')
    peer = page.locator('section[data-host="home"]')
    expect(local.locator(".badge")).to_have_attribute("data-state", "stopped")
    expect(peer).to_have_attribute("data-reachable", "yes")
    expect(peer.locator('tr[data-capsule="desk-b"] .badge')).to_have_attribute("data-state", "stopped")
    expect(page.locator("#whoami")).to_contain_text(a.id)
    expect(page.locator("#alert")).to_be_hidden()        # no error so far
    cookies = page.context.cookies()
    assert cookies and all(c["secure"] and c["httpOnly"] for c in cookies)  # over TLS: Secure

    # start it from the page: busy, then running, and the host agrees
    local.locator('button[data-action="start"]').click()
    expect(local.locator(".badge")).to_have_attribute("data-state", "running", timeout=120_000)
    assert capsules.state_of(a, "desk-a").state == "running"
    expect(local.locator('button[data-action="suspend"]')).to_be_visible()
    expect(local.locator('button[data-action="start"]')).to_have_count(0)
    _shot(page, tmp_path, "dashboard")

    # the peer goes down while the page is open: marked unreachable, this host's list still works
    agent_b.stop()
    expect(peer).to_have_attribute("data-reachable", "no", timeout=20_000)
    expect(peer.locator(".badge")).to_have_text("unreachable")
    expect(peer.locator(".error")).to_contain_text("cannot reach")
    expect(local.locator(".badge")).to_have_attribute("data-state", "running")

    # suspend it from the page: a new active version with its memory image, listed with its size
    local.locator('button[data-action="suspend"]').click()
    expect(local.locator(".badge")).to_have_attribute("data-state", "suspended", timeout=120_000)
    v = a.catalogue.latest_version("desk-a")
    assert (v.number, v.active) == (2, True)
    expect(local).to_contain_text("@2")
    expect(local).to_contain_text("with memory")
    expect(local.locator('button[data-action="start"]')).to_be_visible()


def test_refusals_are_shown_and_sign_out_ends_the_session(two_hosts, browser):
    from playwright.sync_api import expect

    a, _b, agent_a, _agent_b = two_hosts
    capsules.create(a, "parent", "tiny", memory="256M")

    page = browser.new_page()
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    row = page.locator('section[data-host="local"] tr[data-capsule="parent"]')
    expect(row).to_be_visible()

    # derive through the dialog; then a second derive with the same name is refused, and the page says why
    for _ in range(2):
        row.locator('button[data-action="derive"]').click()
        page.fill("#derive-child", "kid")
        page.click('#derive-dialog button[value="ok"]')
    expect(page.locator("#alert")).to_be_visible()
    expect(page.locator("#alert-text")).to_contain_text("a capsule named 'kid' already exists")
    expect(page.locator('section[data-host="local"] tr[data-capsule="kid"]')).to_be_visible()
    assert a.catalogue.capsule("kid") is not None

    # remove the child through its dialog
    page.locator('tr[data-capsule="kid"] button[data-action="rm"]').click()
    page.click('#rm-dialog button[value="ok"]')
    expect(page.locator('tr[data-capsule="kid"]')).to_have_count(0)
    assert a.catalogue.capsule("kid") is None

    page.click("#sign-out")
    expect(page.locator("#sign-in")).to_be_visible()
    page.reload()
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.request.get(f"{agent_a.url}/api/capsules").status == 401


@pytest.mark.parametrize("two_hosts", [True], ids=["tls"], indirect=True)
def test_sign_in_as_a_user_shows_only_their_capsules(two_hosts, browser):
    """Once an admin exists the host's token is refused with the reason; a wrong password is refused; an owner
    signed in with name and password sees its own capsule and not another's."""
    from playwright.sync_api import expect

    from capsule.accounts import owners, users

    a, _b, agent_a, _agent_b = two_hosts
    capsules.create(a, "mine", "tiny", memory="256M")
    capsules.create(a, "theirs", "tiny", memory="256M")
    users.add(a, "root", "admin", "the admin's password")
    users.add(a, "alice", "owner", "alice's password")
    owners.set_owner(a, "mine", "alice")

    page = browser.new_page()
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#sign-in-error")).to_contain_text("capsule token create")
    page.fill("#user", "alice")
    page.fill("#password", "not alice's password")
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#sign-in-error")).to_contain_text("Wrong user name or password")
    page.fill("#password", "alice's password")
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator('section[data-host="local"] tr[data-capsule="mine"]')).to_be_visible()
    expect(page.locator("#whoami")).to_contain_text("alice (owner)")
    expect(page.locator('tr[data-capsule="theirs"]')).to_have_count(0)
    expect(page.locator("#tree")).to_be_hidden()
