"""Demand-paged capsule disks (§4.3) from the capsule side.

A version may name layers this host does not hold: *remote layers*, known by
their manifest (fetched before start, ``remote/<id>.manifest``) and the agent
they come from, or the repository (an instant restore: the source is opened
by :mod:`capsule.repo.pagein`, with the layer's ``remote/<id>.places``).
Starting such a version starts a disk server (nbdkit,
``diskserver/``) that exports the flattened chain read-only; the instance's
private leaf uses that export as its backing. Blocks of remote layers are
fetched when the guest reads them, into shadows shared by every capsule that
uses the layer (``shadows/``). Once every block of a remote layer is local,
``localize`` turns it into an ordinary sealed layer and the version no longer
depends on the source host (or repository)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from capsule import qemuimg
from capsule.errors import AuthFailed, Error, NotFound
from capsule.runtime import guestaccess
from capsule.store import Store
from capsule.store.modes import OBJECT_MODE
from diskserver import ChainSpec, DiskServer, LayerSpec, RemoteSpec, RetrySpec
from diskserver.chain import ReadaheadSpec
from hashcache.atomic import write_atomic
from hashcache.manifest import Manifest
from hashcache.shadow import Shadow


def remote_dir(store: Store) -> Path:
    d = store.home / "remote"
    d.mkdir(exist_ok=True)
    return d


def shadow_dir(store: Store) -> Path:
    d = store.home / "shadows"
    d.mkdir(exist_ok=True)
    return d


def remote_info_path(store: Store, layer_id: str) -> Path:
    return remote_dir(store) / f"{layer_id}.json"


def remote_manifest_path(store: Store, layer_id: str) -> Path:
    return remote_dir(store) / f"{layer_id}.manifest"


def places_path(store: Store, layer_id: str) -> Path:
    """Where a layer paged in from a repository has its blocks' places (:mod:`capsule.repo.pagein`)."""
    return remote_dir(store) / f"{layer_id}.places"


def is_remote(store: Store, layer_id: str) -> bool:
    return remote_info_path(store, layer_id).exists() and not store.layer_path(layer_id).exists()


def token_path(store: Store, url: str) -> Path:
    return remote_dir(store) / f"token-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def token_file_for(store: Store, url: str, token: str) -> Path:
    """The token for ``url``, kept 0600 beside the remote manifests (the disk server reads it)."""
    path = token_path(store, url)
    if not path.exists() or path.read_text().strip() != token:
        write_atomic(path, (token + "\n").encode(), durable=False, mode=0o600)
    return path


def add_remote_layer(store: Store, manifest: Manifest, url: str, token: str, fingerprint: str | None = None, *,
                     opener: str | None = None) -> None:
    """Remember a layer held by the agent at ``url`` (its certificate pinned to ``fingerprint``), by its
    (verified) manifest. With ``opener`` the source is no agent but what that function opens (a repository:
    :mod:`capsule.repo.pagein`), ``token`` its secret."""
    lid = manifest.digest
    if not remote_manifest_path(store, lid).exists():
        manifest.write(remote_manifest_path(store, lid), mode=OBJECT_MODE)
    info = {"id": lid, "parent": manifest.parent, "url": url, "token_file": str(token_file_for(store, url, token)),
            "virtual_size": manifest.size, "added": time.time(), "fingerprint": fingerprint, "opener": opener}
    write_atomic(remote_info_path(store, lid), json.dumps(info).encode(), durable=False)


def remote_info(store: Store, layer_id: str) -> dict[str, Any]:
    try:
        return json.loads(remote_info_path(store, layer_id).read_text())
    except (OSError, ValueError) as exc:
        raise NotFound(f"layer {layer_id[:12]} is neither here nor known as a remote layer") from exc


def chain_needs_server(store: Store, chain: list[str]) -> bool:
    return any(is_remote(store, lid) for lid in chain)


def chain_spec(store: Store, chain: list[str], name: str, prefetch: bool = False) -> ChainSpec:
    layers = []
    for lid in chain:
        if is_remote(store, lid):
            info = remote_info(store, lid)
            layers.append(LayerSpec(id=lid, manifest_path=str(remote_manifest_path(store, lid)),
                                    remote=RemoteSpec(url=info["url"], token_file=info["token_file"],
                                                      fingerprint=info.get("fingerprint"),
                                                      opener=info.get("opener"))))
        else:
            layers.append(LayerSpec(id=lid, manifest_path=str(store.layer_manifest_path(lid)),
                                    local_path=str(store.layer_path(lid))))
    return ChainSpec(layers=tuple(layers), shadow_dir=str(shadow_dir(store)), hash_cache=str(store.cache_path),
                     readahead=ReadaheadSpec(), retry=RetrySpec(seconds=float(os.environ.get(
                         "CAPSULE_SOURCE_RETRY_SECONDS", "10"))), prefetch=prefetch, name=name)


def server_for(inst_dir: Path, disk: int) -> DiskServer:
    return DiskServer.attach(inst_dir / f"disk{disk}.spec.json", inst_dir / f"disk{disk}.nbd",
                             inst_dir / f"disk{disk}.diskserver.log", socket_group=guestaccess.socket_group())


def start_servers(store: Store, inst_dir: Path, chains: list[list[str]], prefetch: bool) -> dict[int, DiskServer]:
    """A disk server for every disk whose chain has a remote layer (outlives the calling process)."""
    servers: dict[int, DiskServer] = {}
    try:
        for i, chain in enumerate(chains):
            if not chain_needs_server(store, chain):
                continue
            spec = chain_spec(store, chain, f"{inst_dir.name}-disk{i}", prefetch=prefetch)
            spec_path = inst_dir / f"disk{i}.spec.json"
            spec.save(spec_path)
            server = DiskServer(spec_path, inst_dir / f"disk{i}.nbd", inst_dir / f"disk{i}.diskserver.log",
                                socket_group=guestaccess.socket_group())
            servers[i] = server.start()
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def server_sockets(inst_dir: Path, still_over: list[bool]) -> dict[int, Path]:
    """Disk index -> its running disk server's socket, for the disks whose leaf still stands on one."""
    return {i: server_for(inst_dir, i).socket_path for i, over in enumerate(still_over)
            if over and server_for(inst_dir, i).alive()}


def stop_servers(inst_dir: Path) -> None:
    for spec in sorted(inst_dir.glob("disk*.spec.json")):
        i = int(spec.name[4:].split(".")[0])
        with contextlib.suppress(Exception):
            server_for(inst_dir, i).stop()


def create_leaf_over(leaf: Path, server: DiskServer) -> None:
    qemuimg.create_leaf_on(leaf, server.qemu_backing(), "raw")


def repoint_leaf(leaf: Path, parent_id: str) -> None:
    """Before sealing a leaf that stood on a disk server: name its real parent layer in its header."""
    qemuimg.rebase_unsafe(leaf, leaf.parent / f"{parent_id}.qcow2")


def stats(inst_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in sorted(inst_dir.glob("disk*.spec.json")):
        with contextlib.suppress(Exception):
            s = ChainSpec.load(spec)
            out[spec.name.split(".")[0]] = json.loads(s.resolved_stats_path.read_text())
    return out


# -- becoming local ---------------------------------------------------------------------------------

def layer_progress(store: Store, layer_id: str) -> tuple[int, int]:
    """(blocks present, data blocks) of a remote layer's shadow."""
    m = Manifest.read(remote_manifest_path(store, layer_id))
    data = [i for i, z, _h in m.records() if not z]
    base = shadow_dir(store) / layer_id
    if not base.with_name(base.name + ".bitmap").exists():
        return 0, len(data)
    with Shadow(base, m.block_count) as sh:
        return len(data) - len(sh.missing(data)), len(data)


def complete_layers(store: Store) -> list[str]:
    """The remote layers whose shadows hold every data block: what :func:`localize` would make local now."""
    done = []
    for info_path in sorted(remote_dir(store).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, Error):
            present, total = layer_progress(store, info_path.stem)
            if present == total:
                done.append(info_path.stem)
    return done


def localize(store: Store, lock_timeout: float | None = -1.0) -> list[str]:
    """Turn every remote layer whose shadow is complete into a sealed local layer (rebuilt from the
    shadow and verified against its manifest, like a received layer). Returns the layers localized. A source
    nothing here reads from any more is told so: its grant ends (:func:`release_sources`). ``lock_timeout``:
    how long to wait for the store's lock (as :meth:`Store.lock`; LockTimeout after it)."""
    with store.lock(lock_timeout, purpose="localize remote layers"):   # `capsule localize` beside the localizer
        before = sources_of(store)
        done = _localize(store)
        left = sources_of(store)
    release_sources(store, {url: pin for url, pin in before.items() if url not in left})
    return done


def _localize(store: Store) -> list[str]:
    from capsule.store.objectio import install_received

    done = []
    for info_path in sorted(remote_dir(store).glob("*.json")):
        lid = info_path.stem
        if store.layer_path(lid).exists():
            info_path.unlink(missing_ok=True)
            places_path(store, lid).unlink(missing_ok=True)
            continue
        present, total = layer_progress(store, lid)
        if present < total:
            continue
        m = Manifest.read(remote_manifest_path(store, lid))
        if m.parent and not store.layer_path(m.parent).exists():
            continue  # its parent first (the next round gets it)
        shadow = Shadow(shadow_dir(store) / lid, m.block_count)
        try:
            install_received(store, "layer", m, shadow)  # removes the shadow once the layer is in place
        finally:
            shadow.close()
        info_path.unlink(missing_ok=True)
        places_path(store, lid).unlink(missing_ok=True)
        store.index_object(store.layer_path(lid), m)
        done.append(lid)
    return done + (_localize(store) if done else [])


# -- ending a source's grant ------------------------------------------------------------------------------
RELEASE_TIMEOUT = 5.0


def sources_of(store: Store, layers: list[str] | None = None) -> dict[str, str | None]:
    """The source URLs (with their pinned fingerprints) of these layers that are remote, or of every layer this
    host knows as remote (``layers`` None)."""
    infos = [remote_info_path(store, lid) for lid in layers if is_remote(store, lid)] if layers is not None \
        else sorted(remote_dir(store).glob("*.json"))
    out: dict[str, str | None] = {}
    for path in infos:
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(path.read_text())
            out.setdefault(info["url"], info.get("fingerprint"))
    return out


def sources_in_use(store: Store) -> set[str]:
    """The sources the running instances here read remote layers from."""
    return set(sources_of(store, [lid for inst in store.catalogue.instances() for c in inst.chains for lid in c]))


def release_sources(store: Store, sources: dict[str, str | None], since: float | None = None) -> list[str]:
    """End this host's grant at each source (URL → pinned fingerprint) no running instance reads from — the run
    that used it stopped, or every layer it sent is local now — and forget its token; a token file written after
    ``since`` belongs to a newer run and is kept. The source answers ``DELETE /v1/grants/self``; a token that is
    no grant (the old host token, a user's token) is refused there and kept, and a source out of reach keeps
    the grant until it expires. A source that is no agent (a repository) has no grant: its secret file (the
    repository's key) is removed. Returns the sources whose grant ended."""
    from capsule import hosts
    from hashcache.transport import Call, HttpTransport, check

    ended = []
    for url in sorted(set(sources) - sources_in_use(store)):
        path = token_path(store, url)
        try:
            if since is not None and path.stat().st_mtime > since:
                continue
            token = path.read_text().strip()
        except OSError:
            continue
        if not url.startswith(("http://", "https://")):
            path.unlink(missing_ok=True)
            ended.append(url)
            continue
        try:
            with contextlib.closing(HttpTransport(url, token, timeout=RELEASE_TIMEOUT, connect_timeout=RELEASE_TIMEOUT,
                                                  fingerprint=hosts.pin_for(store, url, sources[url]))) as t:
                check(t.call(Call("DELETE", "/v1/grants/self")), f"agent {url}")
        except AuthFailed:
            pass                      # it had ended already (expired, revoked): the token is useless
        except Error:
            continue                  # no grant, or out of reach: kept
        path.unlink(missing_ok=True)
        ended.append(url)
    return ended
