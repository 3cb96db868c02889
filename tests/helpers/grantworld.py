"""A host for the grant tests: a store with two capsules of real (small) objects — alice's ``alices-desk`` (a
layer and a memory image of its own, two backup versions) and bob's ``bobs-desk`` (its own layer and memory
image), over a shared root layer, kernel and initrd — its users and their tokens, and its agent app."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from capsule.accounts import owners, tokens, users
from capsule.agent.app import create_app
from capsule.store import Store
from capsule.transfer.records import record_version
from tests.helpers.received import receive_file, receive_layer, record_of

A, B = "alices-desk", "bobs-desk"
TOKEN = "the-host-token-0123456789abcdef"


@dataclass
class World:
    store: Store
    app: FastAPI
    client: TestClient
    work: Path
    t: dict[str, str] = field(default_factory=dict)      # tokens: admin, operator, host, alice, bob
    o: dict[str, str] = field(default_factory=dict)      # objects: kernel, initrd, root, a_layer, a_mem, ...

    def record(self, name: str, number: int, note: str = "") -> dict[str, Any]:
        """A version record of ``name`` over its objects here (as a pushing host would send it)."""
        mine = "a" if name == A else "b"
        r = record_of(name, number, [self.o["root"], self.o[f"{mine}_layer"]], self.o["kernel"], self.o["initrd"],
                      self.o[f"{mine}_mem"])
        return r | {"note": note}

    def grant(self, **req: Any) -> str:
        """A grant minted over HTTP by ops' host token (``POST /v1/grants/host``)."""
        r = self.client.post("/v1/grants/host", json={"expires_in": 600} | req, headers=bearer(self.t["host"]))
        assert r.status_code == 200, r.text
        return r.json()["token"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_world(root: Path) -> World:
    store = Store.open(root / "store")
    work = root / "work"
    work.mkdir()
    o = {"kernel": receive_file(store, work, 1, "kernel"), "initrd": receive_file(store, work, 2, "initrd")}
    o["root"] = receive_layer(store, work, 3)
    o["a_layer"], o["a_mem"] = receive_layer(store, work, 4, o["root"]), receive_file(store, work, 5, "memory")
    o["b_layer"], o["b_mem"] = receive_layer(store, work, 6, o["root"]), receive_file(store, work, 7, "memory")
    app = create_app(store.home, TOKEN)
    w = World(store, app, TestClient(app), work, o=o)
    record_version(store, w.record(A, 1))
    record_version(store, w.record(A, 2, "backup"))
    record_version(store, w.record(A, 3, "backup"))
    record_version(store, w.record(B, 1))
    for name, role in (("root", "admin"), ("ops", "operator"), ("alice", "owner"), ("bob", "owner")):
        users.add(store, name, role)
    owners.set_owner(store, A, "alice")
    owners.set_owner(store, B, "bob")
    w.t = {"admin": tokens.create(store, "root", "read,capsules,host,admin")[1],
           "operator": tokens.create(store, "ops", "read,capsules,host")[1],
           "host": tokens.create(store, "ops", "host")[1],
           "alice": tokens.create(store, "alice", "read,capsules")[1],
           "bob": tokens.create(store, "bob", "read,capsules")[1]}
    return w
