"""Instant restore (issue 27): the tiny capsule pushed from host A into a repository on a real SeaweedFS cluster
boots on host B, which never held it, with ``capsule start NAME@V --from s3+http://…``: its disk blocks come
from the repository's packs only as the guest reads them; once the rest is prefetched and localized the
capsule runs with the repository gone. On a third host, ``capsule backup restore NAME@V --from s3+http://…``
(not live) brings the whole version first and runs it as the capsule's new latest version.

Figures (printed): the time from the command to the guest's boot marker, and the bytes on the link to the
repository ÷ the bytes the guest read through the disk server (its counters, ``wire_bytes / guest_bytes``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.lifecycle import demand
from capsule.repo.push import push
from capsule.repo.repository import Repository
from capsule.repo.s3 import Credentials, S3Client, parse_url
from capsule.verify import verify
from hashcache.manifest import Manifest
from testkit.images import make_store
from testkit.seaweedfs import SeaweedCluster
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.timeout(240)]

PASS = "instant restore passphrase"


def test_instant_restore_boots_a_capsule_this_host_never_held(tmp_path, tiny_images):
    cluster = SeaweedCluster(tmp_path / "seaweedfs")
    cluster.start()
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)          # not even the image
    c = make_store(tmp_path / "c", tiny_images)
    try:
        capsules.create(a, "cap", "tiny", memory="256M")
        url = cluster.url("vault", "lab")
        client = S3Client(parse_url(url), Credentials(cluster.access_key, cluster.secret_key))
        push(a, "cap@1", Repository.init(client, PASS.encode()))
        chain = a.catalogue.latest_version("cap").chains[0]

        # `backup restore --from` without --live, on a third host: the whole backup comes first, then it is the
        # capsule's new latest version there, running on local layers
        env_c = dict(os.environ, **cluster.env(), CAPSULE_HOME=str(c.home), CAPSULE_REPO_PASSPHRASE=PASS,
                     COLUMNS="400")
        restored = subprocess.run([sys.executable, "-m", "capsule.cli.main", "backup", "restore", "cap@1", "--from",
                                   url, "--json"], capture_output=True, text=True, env=env_c, timeout=180)
        assert restored.returncode == 0, restored.stderr
        whole = json.loads(restored.stdout)
        assert whole["version"] == "cap@2" and not whole["live"] and whole["remote_layers"] == [], whole
        assert whole["downloaded_bytes"] > 0 and all(c.layer_path(lid).exists() for lid in chain)
        assert not any(demand.is_remote(c, lid) for lid in chain)
        assert run(c, "cap", "echo whole-$((6*7))") == "whole-42"
        lifecycle.stop(c, "cap", force=True)

        env = dict(os.environ, **cluster.env(), CAPSULE_HOME=str(b.home), CAPSULE_REPO_PASSPHRASE=PASS,
                   COLUMNS="400")
        t0 = time.monotonic()
        started = subprocess.run([sys.executable, "-m", "capsule.cli.main", "start", "cap@1", "--from", url, "--json"],
                                 capture_output=True, text=True, env=env, timeout=180)
        to_marker = time.monotonic() - t0
        assert started.returncode == 0, started.stderr
        report = json.loads(started.stdout)
        assert report["remote_layers"] == chain and report["start"]["mode"] == "boot"
        assert run(b, "cap", "echo instant-$((6*7))") == "instant-42"
        assert run(b, "cap", "dd if=/dev/vda of=/dev/null bs=4096 count=64 2>/dev/null && echo read") == "read"

        inst_dir = Path(b.catalogue.instance("cap").dir)
        time.sleep(1.2)                                   # the server writes its counters each second
        stats = json.loads((demand.shadow_dir(b) / f"{inst_dir.name}-disk0.stats.json").read_text())
        disk_size = Manifest.read(demand.remote_manifest_path(b, chain[-1])).size
        data = sum(demand.layer_progress(b, lid)[1] for lid in chain) * 4096
        assert 0 < stats["source_bytes"] < data < disk_size, stats   # on demand: only part of the disk came
        assert stats["fetch_errors"] == 0 and stats["verify_failures"] == 0
        ratio = stats["wire_bytes"] / stats["guest_bytes"]
        print(f"\ninstant restore: boot marker {to_marker:.1f} s after the command (guest boot "
              f"{report['start']['seconds']:.1f} s, files and manifests {report['seconds']:.2f} s, "
              f"{report['downloaded_bytes']} B); the guest read {stats['guest_bytes']} B, {stats['source_bytes']} B "
              f"of blocks came ({stats['wire_bytes']} B on the link): link ÷ read = {ratio:.3f}; disk data {data} B, "
              f"disk {disk_size} B")

        prefetched = subprocess.run([sys.executable, "-m", "diskserver", "prefetch", str(inst_dir / "disk0.spec.json"),
                                     "--json"], capture_output=True, text=True, env=env, timeout=120)
        assert prefetched.returncode == 0, prefetched.stderr
        assert json.loads(prefetched.stdout)["complete"]
        assert demand.localize(b) == chain
        assert not demand.token_path(b, report["url"]).exists()       # the repository's key left this host
        cluster.kill("s3")                                            # the repository is gone
        assert run(b, "cap", "dd if=/dev/vda of=/dev/null bs=1M 2>/dev/null && echo whole") == "whole"
        lifecycle.stop(b, "cap", force=True)
        lifecycle.start(b, "cap")                                     # local layers now: no disk server
        assert run(b, "cap", "echo again") == "again"
        lifecycle.stop(b, "cap", force=True)
        assert verify(b).ok

    finally:
        for store in (b, c):
            if store.catalogue.instance("cap") is not None:
                lifecycle.stop(store, "cap", force=True)
        cluster.remove()
        a.close()
        b.close()
        c.close()
