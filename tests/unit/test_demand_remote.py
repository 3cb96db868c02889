"""What ``capsule run`` remembers about a remote source: its token (0600, rewritten when it changes)."""

from __future__ import annotations

import stat

import pytest

from capsule.lifecycle import demand
from capsule.store import Store

pytestmark = pytest.mark.unit


def test_the_source_token_is_kept_private_and_follows_a_new_token(tmp_path):
    store = Store.open(tmp_path / "s")
    try:
        path = demand.token_file_for(store, "http://work:7070", "a" * 32)
        assert path.read_text() == "a" * 32 + "\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert demand.token_file_for(store, "http://work:7070", "b" * 32) == path
        assert path.read_text() == "b" * 32 + "\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert demand.token_file_for(store, "http://home:7070", "c" * 32) != path
        assert not [p for p in demand.remote_dir(store).iterdir() if p.name.endswith(".tmp")]
    finally:
        store.close()
