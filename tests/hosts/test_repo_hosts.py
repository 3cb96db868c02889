"""The capsule repository shared by the compose hosts through the compose file's object store (a real SeaweedFS
cluster: a master, two volume servers, a filer and its S3 gateway, a service of its own): a capsule stored in it
by host A, with what its guest wrote, is restored at once on host B, which never held it (`backup restore --from
REPO --live`: its disk paged in from the repository as the guest reads it, the rest prefetched in the background,
then made local by B's agent with nobody asking); a capsule derived from it, stored from B, uploads none of the
objects A stored."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from scripts.composehosts import TEST, ComposeError, wait_for

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
    # the backup restored live: it boots at once as the capsule's new version, its disk paged in from there
    started = b.capsule("backup", "restore", version, "--from", url, "--live", env=env, timeout=300)
    assert started["live"] and started["remote_layers"], started   # its disk's layers: in the repository
    assert started["capsule"] == name and started["version"] != version and b.state(name) == "running"
    assert b.guest(name, f"dd if=/dev/vda bs=4096 skip={WORD_BLOCK} count=1 2>/dev/null | head -c 32") == word
    # the rest arrives in the background; B's agent makes the layers local, and the repository's key leaves B
    remote = {f"{lid}.json" for lid in started["remote_layers"]}

    def localized() -> bool:
        return not remote & set(b.sh('ls "$CAPSULE_HOME/remote"').split())

    try:
        wait_for(localized, 300, "B's prefetch of the capsule's layers from the repository and their localizing",
                 interval=3)
    except ComposeError as exc:       # what B's disk server said: the prefetch's progress and errors
        log = b.sh(f'tail -n 30 "$CAPSULE_HOME"/instances/{name}/disk*.diskserver.log || true')
        raise AssertionError(f"{exc}\n{log}") from exc
    key = "token-" + hashlib.sha256(started["from"].encode()).hexdigest()[:16]
    assert key not in b.sh('ls "$CAPSULE_HOME/remote"').split()            # the repository's key left B
    b.capsule("stop", name, "--force")

    # a sibling of it, stored from B: what A stored is not uploaded again
    sibling = f"s{uuid.uuid4().hex[:8]}"
    b.capsule("derive", name, sibling)
    again = b.capsule("repo", "push", sibling, url, env=env, timeout=300)
    assert again["objects"] == again["objects_present"] == stored["objects"], (again, stored)
    assert again["blocks_new"] == 0 and again["uploaded_bytes"] < stored["uploaded_bytes"] / 10, (again, stored)
