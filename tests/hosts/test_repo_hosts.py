"""The capsule repository shared by the compose hosts through the compose file's object store (a real SeaweedFS
cluster: a master, two volume servers, a filer and its S3 gateway, a service of its own): a capsule stored in it
by host A, with what its guest wrote, boots at once on host B, which never held it, its disk paged in from the
repository as the guest reads it (prefetch and localize after it: tests/vm/test_repo_instant.py)."""

from __future__ import annotations

import uuid

import pytest

from scripts.composehosts import TEST

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

PASSPHRASE = "a passphrase only these hosts know"
WORD_BLOCK = 700      # the disk block the guest writes its word to (the tiny guest's root is in memory)


def test_a_capsule_stored_by_a_is_restored_and_boots_on_b(fresh):
    a, b, name = fresh
    endpoint, identity = TEST.object_store()
    url = f"{endpoint}/capsules/t{uuid.uuid4().hex[:8]}"
    env = identity | {"CAPSULE_REPO_PASSPHRASE": PASSPHRASE}
    a.capsule("repo", "init", url, env=env)

    # what the guest writes on A is in the version stored
    a.capsule("start", name)
    word = uuid.uuid4().hex
    a.guest(name, f"printf {word} | dd of=/dev/vda bs=4096 seek={WORD_BLOCK} conv=notrunc 2>/dev/null; sync")
    a.capsule("stop", name)
    stored = a.capsule("repo", "push", name, url, env=env, timeout=300)
    assert stored["blocks_new"] > 0 and stored["uploaded_bytes"] > 0, stored
    version = stored["version"]

    # B never held it; it boots it at once from the repository, its disk paged in from there
    assert name not in b.states()
    listed = b.capsule("repo", "ls", url, env=env)
    assert version in str(listed), listed
    started = b.capsule("start", version, "--from", url, env=env, timeout=300)
    assert started["remote_layers"], started                     # its disk's layers: in the repository
    assert b.guest(name, f"dd if=/dev/vda bs=4096 skip={WORD_BLOCK} count=1 2>/dev/null | head -c 32") == word
    b.capsule("stop", name, "--force")
