"""CLI verbs for the catalogue and hierarchy: create, derive, ls, show,
tree, promote, rm, gc, verify, doctor."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated

import typer
from rich.table import Table
from rich.tree import Tree

from capsule import capsules as lib
from capsule import hierarchy
from capsule.cli import grammar
from capsule.cli.common import JsonOpt, console, emit, json_flag, open_store, progress, short
from capsule.doctor import doctor as run_doctor
from capsule.units import human
from capsule.verify import verify as run_verify
from capsule.views import depends_on, rm_dict, state_dict, tree_dict, version_dict


def create(
    name: Annotated[str, typer.Argument(help="Name of the new capsule.")],
    image: Annotated[str, typer.Option("--image", "-i", help="Image whose root layer the capsule starts from.")],
    memory: Annotated[str, typer.Option("--memory", "-m", help="Guest RAM, e.g. 256M or 1G.")] = "512M",
    cpus: Annotated[int, typer.Option("--cpus", help="Virtual CPUs.")] = 1,
    free_page_reporting: Annotated[bool, typer.Option(
        "--free-page-reporting/--no-free-page-reporting",
        help="Let the guest report free pages, which QEMU then drops (they cost nothing to save).")] = True,
    data_disk: Annotated[list[str] | None, typer.Option(
        "--data-disk", help="Add an empty data disk of this size (vdb, then vdc, …; repeatable), e.g. 20G. "
                            "`capsule update apply` replaces the system disk and keeps these.")] = None,
    pod_network: Annotated[bool, typer.Option(
        "--pod-network", help="Give the machine a NIC on this host's pod bridge (capsulepods0, no address on "
                              "the host): its pods share 198.18.0.0/24 with the pods of the host's other such "
                              "capsules and keep their address and TCP connections when `capsule pod migrate` "
                              "moves them between them.")] = False,
    json: JsonOpt = False,
) -> None:
    """Create a capsule from an image. The image's root layer is shared, not copied.

    Examples:

      capsule create alice --image deb --memory 1G --cpus 2

      capsule create bob --image deb --data-disk 20G      # vda: the system, vdb: bob's data

      capsule create web1 --image debian --pod-network    # its pods on the host's pod network
    """
    json_flag(json)
    store = open_store()
    v = lib.create(store, name, image, memory, cpus, free_page_reporting, data_disks=data_disk or (),
                   pod_network=pod_network)
    emit(version_dict(store, v), lambda: console.print(f"created [bold]{v.ref}[/] from image {image}"))


def derive(
    parent: Annotated[str, typer.Argument(help="NAME or NAME@V to derive from.")],
    child: Annotated[str, typer.Argument(help="Name of the new child capsule.")],
    json: JsonOpt = False,
) -> None:
    """Create a child capsule sharing every layer (and the memory image) of its parent."""
    json_flag(json)
    store = open_store()
    v = lib.derive(store, parent, child)
    emit(version_dict(store, v), lambda: console.print(f"derived [bold]{v.ref}[/] from {parent}"))


def ls(json: JsonOpt = False) -> None:
    """List capsules: latest version, state and sizes."""
    json_flag(json)
    store = open_store()
    states = lib.list_states(store)
    data = [state_dict(store, s) for s in states]

    def show() -> None:
        t = Table("capsule", "state", "latest", "versions", "memory image", "layers")
        for s in states:
            mem = store.catalogue.file(s.latest.memory) if s.latest.memory else None
            t.add_row(s.name, s.state, f"@{s.latest.number}", str(len(store.catalogue.versions(s.name))),
                      human(mem.allocated) if mem else "-", " ".join(str(len(c)) for c in s.latest.chains))
        console.print(t if states else "no capsules yet: `capsule create NAME --image IMG`")

    emit(data, show)


def show(
    ref: Annotated[str, typer.Argument(help="NAME (latest version) or NAME@V.")],
    json: JsonOpt = False,
) -> None:
    """Show a capsule version: its disks' layer chains, memory image and config."""
    json_flag(json)
    store = open_store()
    v = lib.resolve(store, ref)
    st = lib.state_of(store, v.capsule)
    data = version_dict(store, v)
    data["state"] = st.state
    data["versions"] = [x.number for x in store.catalogue.versions(v.capsule)]

    def human_view() -> None:
        console.print(f"[bold]{v.ref}[/]  {'active' if v.active else 'inactive'}  capsule is {st.state}")
        console.print(f"  created   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v.created))}  ({v.note})")
        if data["parent"]:
            console.print(f"  parent    {data['parent']}")
        cfg = v.config
        console.print(f"  machine   {cfg['memory_mib']} MiB, {cfg['vcpus']} vCPU, image {cfg.get('image')}"
                      + (", on the pod network" if cfg.get("pod_network") else ""))
        if data["memory"]:
            m = data["memory"]
            console.print(f"  memory    {short(m['id'])}  {human(m['size'])} logical, "
                          f"{human(m['allocated'])} allocated, {human(m['stored_bytes'])} non-zero")
        for i, disk in enumerate(data["disks"]):
            chain = " → ".join(
                f"{short(x['id'])} (remote, {x['remote']['blocks_local']}/{x['remote']['blocks']} blocks here)"
                if "remote" in x else f"{short(x['id'])} ({human(x['stored_bytes'] or 0)})" for x in disk)
            size = data["disk_sizes"][i]
            role = ("system" + (f" {data['system']}" if data["system"] else "")) if i == 0 else "data"
            sized = f", {human(size)}" if size else ""
            console.print(f"  disk {i}    vd{chr(97 + i)}, {role}{sized}: {chain}")
        remote = depends_on(data)
        console.print(f"  depends   on {', '.join(remote)} (`capsule localize` once all blocks are here)"
                      if remote else "  depends   on no other host")
        console.print(f"  versions  {', '.join('@' + str(n) for n in data['versions'])}")

    emit(data, human_view)


def tree(json: JsonOpt = False) -> None:
    """Draw the hierarchy of layers with the images, capsule versions and running instances on them.

    The paper's Fig. 1. --json prints the graph the dashboard draws (GET /api/tree): layers with their
    parent, images, capsules, versions with their chains, memory images, running instances."""
    json_flag(json)
    store = open_store()
    graph = tree_dict(store)

    def human_view() -> None:
        root = Tree(f"[bold]store {store.id}[/]")
        running = {i["ref"] for i in graph["instances"]}
        branches: dict[str | None, Tree] = {None: root}
        for node in graph["layers"]:
            tags = [f"[cyan]image {n}[/]" for n in node["images"]]
            tags += [f"[bold]{v}[/]" + (" [green]running[/]" if v in running else "") for v in node["versions"]]
            if node["remote"]:
                tags.append(f"[yellow]at {node['remote']['url']}[/]")
            label = f"{short(node['id'])} {human(node['stored_bytes']) if node['stored_bytes'] is not None else '–'} "
            branches[node["id"]] = branches[node["parent"]].add(label + " ".join(tags))
        console.print(root if graph["layers"] else "the store holds no layers yet")

    emit(graph, human_view)


def promote(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@V whose latest layer absorbs its parent.")],
    disk: Annotated[int, typer.Option("--disk", help="Which disk (0 = vda).")] = 0,
    to_root: Annotated[bool, typer.Option("--root", help="Promote repeatedly until the layer is a root.")] = False,
    json: JsonOpt = False,
) -> None:
    """Shorten a chain: fold the parent's blocks into the latest layer (§4.2)."""
    json_flag(json)
    store = open_store()
    with progress("promoting") as say:
        r = hierarchy.promote(store, ref, disk=disk, to_root=to_root, say=say)
    emit({"ref": r.version.ref, "before": r.before, "after": r.after, "rewritten_layers": r.rewritten},
         lambda: console.print(f"{r.version.ref} disk {disk}: chain of {len(r.before)} → {len(r.after)} "
                               f"layers ({r.rewritten} layer(s) rewritten)"))


def rm(
    ref: Annotated[str, typer.Argument(help="NAME (the whole capsule) or NAME@V (one version).")],
    promote_dependants: Annotated[bool, typer.Option(
        "--promote", help="Fold the removed layers into versions that build on them, then remove.")] = False,
    json: JsonOpt = False,
) -> None:
    """Delete a capsule or one version, then collect unreferenced objects.

    Refused while running, and while other versions build on its layers unless
    --promote folds those layers into them first (they stay byte-identical)."""
    json_flag(json)
    store = open_store()
    with progress("removing") as say:
        r = hierarchy.rm(store, ref, promote_dependants=promote_dependants, say=say)
    emit(rm_dict(r),
         lambda: console.print(f"removed {', '.join(r.removed)}; {r.promoted} dependant layer(s) promoted; "
                               f"freed {human(r.gc.freed_bytes)}"))


def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Only say what would go.")] = False,
    drop_pending: Annotated[bool, typer.Option(
        "--drop-pending", help="Also collect objects received for versions that were never recorded "
                               "(kept 24 h otherwise; CAPSULE_PENDING_MAX_AGE).")] = False,
    json: JsonOpt = False,
) -> None:
    """Remove layers, memory images and leaves that nothing references."""
    json_flag(json)
    store = open_store()
    r = hierarchy.gc(store, dry_run=dry_run, max_pending_age=0.0 if drop_pending else None)
    verb = "would free" if dry_run else "freed"
    kept = f"; kept {len(r.pending)} received object(s) awaiting their version" if r.pending else ""
    emit(asdict(r), lambda: console.print(f"{len(r.layers)} layer(s), {len(r.files)} file object(s), "
                                          f"{len(r.leaves)} stale leaf/leaves: {verb} {human(r.freed_bytes)}"
                                          + kept))


def verify(
    fix_modes: Annotated[bool, typer.Option("--fix-modes", help="Set store directories and objects to "
                                                                "their modes (0700, 0400, 0440) first.")] = False,
    json: JsonOpt = False,
) -> None:
    """Re-hash every sealed layer and memory image against its manifest digest.

    Also qemu-img check each layer, and check the modes of the store's directories and files."""
    json_flag(json)
    store = open_store()
    with progress("verifying") as say:
        report = run_verify(store, say, repair_modes=fix_modes)
    data = {"ok": report.ok, "layers": report.checked_layers, "files": report.checked_files,
            "problems": [asdict(p) for p in report.problems]}
    if fix_modes:
        data["fixed_modes"] = report.fixed_modes

    def human_view() -> None:
        for path in report.fixed_modes:
            console.print(f"[yellow]fixed mode[/] {path}")
        for p in report.problems:
            console.print(f"[red]BAD[/] {p.kind} {p.id}: {p.error}")
        console.print(f"checked {report.checked_layers} layer(s) and {report.checked_files} file object(s): "
                      + ("[green]all good[/]" if report.ok else f"[red]{len(report.problems)} problem(s)[/]"))

    emit(data, human_view)
    if not report.ok:
        raise typer.Exit(6)


def doctor(
    no_probe: Annotated[bool, typer.Option("--no-probe", help="Skip the KVM probe boot.")] = False,
    reprobe: Annotated[bool, typer.Option("--reprobe", help="Probe KVM again instead of using the "
                                                            "verdict cached for this host boot.")] = False,
    json: JsonOpt = False,
) -> None:
    """Check the host: tools and versions, libvirt, and KVM vs TCG (with the reason)."""
    json_flag(json)
    try:
        store = open_store()
    except Exception:  # noqa: BLE001 - doctor reports, never fails on the store
        store = None
    report = run_doctor(store, probe=not no_probe, reprobe=reprobe)

    def human_view() -> None:
        for c in report.checks:
            console.print(f"{'[green]ok[/]  ' if c.ok else '[red]BAD[/] '} {c.name:20} {c.detail}")
        console.print(f"accelerator: [bold]{report.accel}[/] — {report.accel_reason}")

    emit(report.as_dict(), human_view)
    if not report.ok:
        raise typer.Exit(9)


def register(app: typer.Typer) -> None:
    for fn in (create, derive, ls, show, tree, promote, rm):
        app.command(rich_help_panel=grammar.CAPSULES)(fn)


def register_diagnostics(app: typer.Typer) -> None:
    for fn in (gc, verify, doctor):
        app.command(rich_help_panel=grammar.DIAGNOSTICS)(fn)
