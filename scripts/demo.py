"""`make demo`: the main job end to end on this host.

Builds the tiny guest image, creates a capsule, boots it, starts a counter
inside, suspends it (sparse memory image + sealed layer), resumes it and
shows that the counter went on from where it stopped, then prints what it
cost."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from capsule import capsules, hierarchy, images, lifecycle
from capsule.errors import CapsuleError
from capsule.runtime.console import ConsoleSession
from capsule.store import Store
from capsule.units import human

NAME = "demo"
COUNTER = "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &"
out = Console(highlight=False)


def step(msg: str) -> None:
    out.print(f"[bold blue]==>[/] {msg}")


def guest(store: Store, command: str) -> str:
    with ConsoleSession(store.domain_name(NAME)) as c:
        return c.run(command)


def main() -> int:
    store = Store.open()
    step(f"store {store.home} (id {store.id})")
    t = time.monotonic()
    with out.status("building the tiny image (first run downloads a kernel)"):
        row, built = images.build(store, "tiny", "tiny")
    step(f"image tiny {'built' if built else 'already built'} in {time.monotonic() - t:.1f}s")

    if store.catalogue.capsule(NAME) is not None:
        if store.catalogue.instance(NAME) is not None:
            lifecycle.stop(store, NAME, force=True)
        hierarchy.rm(store, NAME, promote_dependants=True)
    capsules.create(store, NAME, "tiny", memory="256M")
    step(f"created capsule {NAME} (256 MiB RAM) on the image's root layer")

    boot = lifecycle.start(store, NAME)
    step(f"booted {boot.version.ref} under {boot.accel.upper()} in {boot.seconds:.2f}s")
    guest(store, COUNTER)
    guest(store, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=1000 count=256 conv=notrunc 2>/dev/null; sync")
    time.sleep(2)
    before = int(guest(store, "cat /tmp/count"))
    step(f"counter in the guest is at {before}; wrote 1 MiB to its disk")

    sealed = lifecycle.suspend(store, NAME)
    assert sealed.version and sealed.memory
    step(f"suspended → {sealed.version.ref}")
    resumed = lifecycle.start(store, NAME)
    after = int(guest(store, "cat /tmp/count"))
    step(f"resumed {resumed.version.ref} in {resumed.seconds:.2f}s; counter went on at {after} (no reboot)")

    t = Table(title="what it cost")
    t.add_column("item")
    t.add_column("value", justify="right")
    mem = sealed.memory
    t.add_row("guest RAM", "256.0 MiB")
    t.add_row("memory image, logical size", human(mem.size))
    t.add_row("memory image, allocated on disk", human(mem.allocated))
    t.add_row("memory image, non-zero blocks", human(mem.stored_bytes))
    for layer in sealed.layers:
        t.add_row(f"new disk layer {layer.id[:12]}", f"{human(layer.stored_bytes)} data, {human(layer.file_size)} file")
    root = store.catalogue.layer(row.root_layer)
    t.add_row("shared root layer (not copied)", human(root.stored_bytes) if root else "?")
    t.add_row("save (libvirt sparse)", f"{sealed.save_seconds:.2f} s")
    t.add_row("seal (hash + manifests)", f"{sealed.seal_seconds:.2f} s")
    t.add_row("restore", f"{resumed.seconds:.2f} s")
    t.add_row("counter before → after", f"{before} → {after}")
    out.print(t)
    lifecycle.stop(store, NAME, force=True)
    ok = before <= after < before + 50
    out.print("[green]demo OK[/]" if ok else "[red]the counter did not continue[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CapsuleError as exc:
        out.print(f"[red]demo failed:[/] {exc}")
        sys.exit(1)
