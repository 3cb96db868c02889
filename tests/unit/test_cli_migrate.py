"""`capsule migrate`'s live view and its Ctrl-C: the first one cancels, a second one interrupts."""

from __future__ import annotations

import signal

import pytest
from rich.console import Console

from capsule.cli.migrate import ctrl_c_cancels, render
from capsule.migrate.progress import CancelToken, Snapshot

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _text(s: Snapshot) -> str:
    c = Console(width=100, record=True, color_system=None)
    c.print(render(s))
    return c.export_text()


def test_the_view_shows_each_phase_with_its_state_and_the_counters():
    s = Snapshot(7, "vm", "b", ("save", "memory", "disk", "resume"), "disk", wire_bytes=3 << 20,
                 local_bytes=1 << 20, done_bytes=5 << 20, total_bytes=10 << 20, phase_done=1 << 20,
                 phase_total=6 << 20, eta_seconds=4.2)
    lines = _text(s).splitlines()
    assert lines[0].startswith("✓ save") and lines[1].startswith("✓ memory")
    assert lines[2].startswith("▶ disks") and "1.0 MiB / 6.0 MiB" in lines[2]
    assert lines[3].startswith("· resume")
    assert "wire 3.0 MiB" in lines[4] and "found locally 1.0 MiB" in lines[4] and "ETA 4s" in lines[4]
    assert "Ctrl-C cancels" in lines[5]
    done = _text(Snapshot(9, "vm", "b", ("save", "resume"), "resume", outcome="done", cancellable=False))
    assert done.splitlines()[1].startswith("✓ resume") and "Ctrl-C" not in done


def test_first_ctrl_c_cancels_the_second_interrupts():
    token = CancelToken()
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_cancels(token):
        signal.raise_signal(signal.SIGINT)
        assert token.cancelled
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_after_the_point_of_no_return_does_not_cancel():
    token = CancelToken()
    token.commit()
    with ctrl_c_cancels(token):
        signal.raise_signal(signal.SIGINT)
    assert not token.cancelled


def test_to_is_a_known_hosts_name_or_a_url_with_a_token_file(tmp_path, monkeypatch):
    from capsule import hosts
    from capsule.cli.common import PeerCall, resolve_peer
    from capsule.errors import NotFound
    from capsule.store import Store
    from tests.helpers.inprocess_agent import InProcessAgent

    monkeypatch.delenv("CAPSULE_TOKEN", raising=False)
    token = "the-peer-token-0123456789abcdef"
    peer = InProcessAgent(tmp_path / "b", token)
    store = Store.open(tmp_path / "a")
    try:
        hosts.add(store, "home", peer.url, token)
        assert resolve_peer(store, "home") == PeerCall(peer.url, token, "home", None)
        with pytest.raises(NotFound):
            resolve_peer(store, "office")
        f = tmp_path / "other.token"
        f.write_text("x" * 24 + "\n")
        assert resolve_peer(store, "http://other:7070", f) == PeerCall("http://other:7070", "x" * 24,
                                                                       "http://other:7070", None)
    finally:
        peer.stop()
        store.close()
