"""``capsule fleet push NAME@V --via REPO`` against a real SeaweedFS cluster and three real agents on loopback
(no guests): the origin uploads the version to the repository once and sends nothing to any host; hosts restore
it from the repository or pull it from a peer that has it; bad input (a wrong passphrase, an unreachable store,
a version this store lacks) is refused before anything is sent, to the hosts or to the bucket."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from capsule import audit, capsules
from capsule.agentclient import AgentClient
from capsule.cli.main import app as cli
from capsule.errors import AuthFailed, InvalidName, NotFound, Unreachable
from capsule.fleet import hostops, members
from capsule.fleet import push as pushing
from capsule.fleet.via import Via
from capsule.repo.repository import Repository
from capsule.repo.s3 import Credentials, S3Client, parse_url
from capsule.verify import verify
from testkit.fleetkit import new_version
from testkit.images import make_store
from testkit.seaweedfs import SeaweedCluster
from tests.conftest import Agent

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

NAMES = ["h1", "h2", "h3"]
PASS = "a fleet's repository passphrase"
MiB = 1 << 20


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    cluster = SeaweedCluster(tmp_path_factory.mktemp("seaweedfs"), volumes=1)
    cluster.start()
    yield cluster
    cluster.remove()


class Fleet:
    def __init__(self, tmp_path, images, seaweed, bucket):
        self.origin = make_store(tmp_path / "origin", images, "tiny")
        capsules.create(self.origin, "web", "tiny", memory="256M")
        new_version(self.origin, "web", MiB, seed=27)                # web@2: one new 1 MiB layer
        self.stores = {n: make_store(tmp_path / n, images, "tiny") for n in NAMES}
        self.agents = {n: Agent(self.stores[n].home, tmp_path / f"{n}.token") for n in NAMES}
        for n in NAMES:
            members.add(self.origin, n, self.agents[n].url, self.agents[n].token, "edge")
        self.url = seaweed.url(bucket, "fleet")
        self.client = S3Client(parse_url(self.url), Credentials(seaweed.access_key, seaweed.secret_key))
        Repository.init(self.client, PASS.encode(), scrypt_n=2**10)

    def bucket(self) -> list[str]:
        return sorted(name for name, _size in self.client.list("fleet/"))

    def holds(self) -> dict[str, list[str]]:
        return {n: [v.ref for v in s.catalogue.versions()] for n, s in self.stores.items()}

    def received(self, n: str) -> list[str]:
        """The calls that put something into host ``n``'s store from outside (a push: receive, record)."""
        return [e.get("action", "") for e in audit.entries(self.stores[n].home)
                if "/v1/recv/" in e.get("action", "") or e.get("action", "").endswith("/v1/versions")]

    def close(self):
        for a in self.agents.values():
            a.stop()
        self.client.close()


@pytest.fixture
def fleet(request, tmp_path, tiny_images, seaweed, monkeypatch):
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CAPSULE_REPO_PASSPHRASE", PASS)
    f = Fleet(tmp_path, tiny_images, seaweed, request.node.name.replace("_", "-")[-40:].strip("-").lower())
    yield f
    f.close()


def test_rollout_via_the_repository_sends_nothing_from_the_origin_to_any_host(fleet):
    runner = CliRunner()
    r = runner.invoke(cli, ["--home", str(fleet.origin.home), "fleet", "push", "web@2", "--via", fleet.url,
                            "--parallel", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["completed"] and {h["host"]: h["state"] for h in out["hosts"]} == dict.fromkeys(NAMES, "done")
    sources = {h["host"]: h["source"] for h in out["hosts"]}
    from_repo = [n for n, s in sources.items() if s == "repository"]
    from_peer = [n for n, s in sources.items() if s in NAMES]
    assert from_repo and from_peer and len(from_repo) + len(from_peer) == 3, sources
    # the origin sent the store the version once (its new layer's random MiB at least), and no host anything
    assert out["via"]["url"] == fleet.url and out["via"]["origin_sent_bytes"] > MiB
    assert all(fleet.received(n) == [] for n in NAMES)
    print(f"\nvia: origin uploaded {out['via']['origin_sent_bytes']} B to the store, 0 to hosts; "
          + ", ".join(f"{h['host']} {h['bytes']} B from {h['source']}" for h in out["hosts"]))
    # as the agents tell: a repository host restored from the bucket, a peer host pulled from that peer
    for n in NAMES:
        pulls = hostops.activity(members.get(fleet.origin, n))["pulls"]
        want = fleet.url if sources[n] == "repository" else fleet.agents[sources[n]].url
        assert [(p["ref"], p["source"]) for p in pulls] == [("web@2", want)], (n, pulls)
        assert pulls[0]["wire_bytes"] > MiB // 2                    # the new layer came over
    for n, s in fleet.stores.items():
        ours, theirs = fleet.origin.catalogue.version("web", 2), s.catalogue.version("web", 2)
        assert theirs is not None and theirs.chains == ours.chains, n
        assert verify(s).ok, n
    # the repository's record is this version already: asked again, the origin uploads nothing
    records = [n for n in fleet.bucket() if "/versions/" in n]
    via = Via.open(fleet.url, PASS.encode())
    assert via.upload(fleet.origin, "web@2") is None and via.report()["origin_sent_bytes"] == 0
    via.close()
    assert [n for n in fleet.bucket() if "/versions/" in n] == records and len(records) == 1
    # a rerun: every host holds it, nothing is sent, not even to the store
    r = runner.invoke(cli, ["--home", str(fleet.origin.home), "fleet", "push", "web@2", "--via", fleet.url, "--json"])
    assert r.exit_code == 0, r.output
    again = json.loads(r.output)
    assert {h["state"] for h in again["hosts"]} == {"already"} and again["via"]["origin_sent_bytes"] == 0
    r = runner.invoke(cli, ["--home", str(fleet.origin.home), "fleet", "push", "web@2", "--via", fleet.url])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and f"via {fleet.url}: this host uploaded 0 B" in said, r.output
    assert "sent nothing to any host" in said and "rollout complete" in said
    # rollback goes through the repository too: web@1's objects are all there, only its record is new
    r = runner.invoke(cli, ["--home", str(fleet.origin.home), "fleet", "rollback", "web@1", "--via", fleet.url,
                            "--parallel", "1", "--json"])
    assert r.exit_code == 0, r.output
    back = json.loads(r.output)
    assert {h["state"] for h in back["hosts"]} == {"done"} and "repository" in {h["source"] for h in back["hosts"]}
    assert back["via"]["blocks_new"] == 0 and back["via"]["objects_present"] > 0
    assert all("web@1" in fleet.holds()[n] and fleet.received(n) == [] for n in NAMES)


def test_bad_input_is_refused_before_anything_is_sent(fleet):
    before_bucket, before_hosts = fleet.bucket(), fleet.holds()
    opts = pushing.PushOptions(parallel=1, via=fleet.url, via_secret=b"not the passphrase")
    with pytest.raises(AuthFailed, match="wrong passphrase.*nothing was sent to any host"):
        pushing.push(fleet.origin, "web@2", opts)
    with pytest.raises(Unreachable, match="cannot be reached.*nothing was sent to any host"):
        pushing.push(fleet.origin, "web@2", pushing.PushOptions(via="s3+http://127.0.0.1:1/fleet/x",
                                                                via_secret=PASS.encode()))
    with pytest.raises(NotFound, match="no version 7"):
        pushing.push(fleet.origin, "web@7", pushing.PushOptions(via=fleet.url, via_secret=PASS.encode()))
    assert fleet.bucket() == before_bucket and fleet.holds() == before_hosts
    assert all(fleet.received(n) == [] for n in NAMES)
    # a host handed a key that does not open the repository, or credentials the store refuses: nothing restored
    via = Via.open(fleet.url, PASS.encode())
    body = via.body("web@2")
    via.close()
    h1 = members.get(fleet.origin, "h1")
    wrong_key = body | {"key": body["key"] | {"master": base64.b64encode(bytes(64)).decode()}}
    wrong_creds = body | {"credentials": {"access_key": "nobody", "secret_key": "not-the-secret-key"}}
    with AgentClient(h1.peer.url, h1.peer.token) as client:
        with pytest.raises(InvalidName, match="key given does not open the repository"):
            client.post_json("/v1/fleet/restore", wrong_key)
        with pytest.raises(AuthFailed, match="object store refused the credentials"):
            client.post_json("/v1/fleet/restore", wrong_creds)
    assert fleet.bucket() == before_bucket and fleet.holds() == before_hosts
    # the same through the real entry point: one clear line, the error's exit code, nothing sent
    env = os.environ | {"CAPSULE_REPO_PASSPHRASE": "not the passphrase"}
    cmd = [sys.executable, "-m", "capsule.cli.main", "--home", str(fleet.origin.home), "fleet", "push", "web@2"]
    r = subprocess.run([*cmd, "--via", fleet.url], capture_output=True, text=True, timeout=60, env=env)
    said = " ".join(r.stderr.split())          # the message as one line, however the terminal wrapped it
    assert r.returncode == AuthFailed.exit_code and "wrong passphrase" in said, r.stderr
    assert "nothing was sent to any host" in said and "Traceback" not in said
    r = subprocess.run([*cmd, "--via", "ftp://x/y"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "not a repository URL" in " ".join(r.stderr.split()), r.stderr
    assert fleet.bucket() == before_bucket and fleet.holds() == before_hosts
