"""A rollout ``--via REPO``: the origin stores the version in a repository once (only the blocks it lacks), and
each host that gets it from no peer restores it from the repository (``POST /v1/fleet/restore`` on its agent),
so the origin's uplink carries the version once, whatever the fleet's size.

The repository is opened here as ``capsule repo`` opens it (the secret: a key file, CAPSULE_REPO_PASSPHRASE or
a prompt; S3 credentials from the environment): a wrong passphrase, a missing repository or an unreachable
store is an error before anything is sent. A host is handed the opened key and the credentials for its one
call, over the agents' authenticated channel (TLS off loopback), and keeps them only in memory."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from capsule.agentclient import AgentClient
from capsule.bounds import WIRE_BYTES
from capsule.capsules import resolve
from capsule.errors import AuthFailed, NotFound, TransferFailed, Unreachable
from capsule.fleet.members import Member
from capsule.repo import push as repo_push
from capsule.repo.repository import Repository
from capsule.repo.s3 import Credentials, S3Client, credentials_from_environment, parse_url
from capsule.store import Store
from capsule.transfer.records import version_record

RESTORE_TIMEOUT = 3600.0


@dataclass
class Via:
    """An opened repository a rollout goes through, and what the origin sent to it."""
    repo: Repository = field(repr=False)
    credentials: Credentials = field(repr=False)
    uploaded: repo_push.PushReport | None = None

    @property
    def url(self) -> str:
        return self.repo.location.url

    @classmethod
    def open(cls, url: str, secret: bytes) -> Via:
        """The repository at ``url`` opened with ``secret``; its errors say that nothing was sent."""
        location = parse_url(url)
        credentials = credentials_from_environment()
        try:
            repo = Repository.open(S3Client(location, credentials), secret)
        except (AuthFailed, NotFound, Unreachable) as exc:
            raise type(exc)(f"--via {location.url}: {exc}; nothing was sent to any host") from exc
        return cls(repo, credentials)

    def upload(self, store: Store, ref: str) -> repo_push.PushReport | None:
        """Store ``ref`` in the repository (only the blocks it lacks): the origin's one upload. Nothing when the
        repository's latest record of ``ref`` is this store's version already (an earlier rollout's)."""
        if self.holds(store, ref):
            return None
        self.uploaded = repo_push.push(store, ref, self.repo)
        return self.uploaded

    def holds(self, store: Store, ref: str) -> bool:
        """Whether the record the hosts would restore for ``ref`` is this store's version (same layers, memory)."""
        from capsule.repo.restore import find_version

        ours = version_record(store, resolve(store, ref))
        try:
            _name, body = find_version(self.repo, ref)
        except NotFound:
            return False
        theirs = body.get("record") if isinstance(body, dict) else None
        return isinstance(theirs, dict) and theirs.get("chains") == ours["chains"] \
            and theirs.get("memory") == ours["memory"]

    def body(self, ref: str) -> dict[str, Any]:
        """The restore request for one host: the repository, the version, the opened key, the credentials."""
        creds: dict[str, Any] = {"access_key": self.credentials.access_key, "secret_key": self.credentials.secret_key}
        if self.credentials.session_token:
            creds["session_token"] = self.credentials.session_token
        master = base64.b64encode(self.repo.key.enc + self.repo.key.ids).decode()
        return {"repository": self.url, "ref": ref, "key": {"id": self.repo.key_id, "master": master},
                "credentials": creds, "region": self.repo.client.region}

    def restore_on(self, member: Member, ref: str) -> int:
        """The member's agent restores ``ref`` from the repository; the bytes it downloaded."""
        with AgentClient(member.peer.url, member.peer.token, timeout=RESTORE_TIMEOUT,
                         fingerprint=member.peer.fingerprint) as client:
            reply = client.post_json("/v1/fleet/restore", self.body(ref))
        got = reply.get("downloaded_bytes", 0) if isinstance(reply, dict) else 0
        return int(WIRE_BYTES.check(got, f"{member.name}'s downloaded_bytes", TransferFailed))

    def report(self) -> dict[str, Any]:
        """What the origin sent: to the repository only (never to a host)."""
        up = self.uploaded
        return {"url": self.url, "origin_sent_bytes": up.uploaded_bytes if up else 0,
                "blocks_new": up.blocks_new if up else 0, "blocks_known": up.blocks_known if up else 0,
                "objects_present": up.objects_present if up else 0, "uploaded": up is not None}

    def close(self) -> None:
        self.repo.client.close()
