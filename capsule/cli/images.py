"""CLI verbs for guest images: ``capsule image build|ls``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from capsule import images as lib
from capsule.cli.common import JsonOpt, console, emit, json_flag, open_store, progress, short
from capsule.units import human

app = typer.Typer(no_args_is_help=True)


@app.command()
def build(
    kind: Annotated[str, typer.Argument(help="tiny (busybox initramfs, boots in seconds), debian "
                                             "(bookworm with systemd, python3, criu) or desktop (debian plus "
                                             "X, the JWM window manager, xterm and the Dillo browser, logged "
                                             "in by itself on the screen).")],
    name: Annotated[str, typer.Argument(help="Name to store the image under.")],
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Build again even if it exists.")] = False,
    disk_size: Annotated[str | None, typer.Option(
        "--disk-size", help="Root disk size (debian: 2G, desktop: 3G by default).")] = None,
    json: JsonOpt = False,
) -> None:
    """Build a guest image into the store (a no-op if it exists, unless --rebuild).

    Needs root, mmdebstrap and apt access to Debian bookworm for debian and desktop.
    Examples: `capsule image build tiny tiny`, `capsule image build desktop desk`, then
    `capsule create d1 --image desk --memory 1G`, `capsule start d1`: start returns once the
    desktop is on the capsule's screen (the dashboard's console shows it)."""
    json_flag(json)
    store = open_store()
    with progress(f"building {kind} image {name}") as say:
        row, built = lib.build(store, kind, name, rebuild=rebuild, say=say, disk_size=disk_size)
    emit({"name": row.name, "kind": row.kind, "built": built, "root_layer": row.root_layer, "info": row.info},
         lambda: console.print(f"{'built' if built else 'already present:'} image [bold]{row.name}[/] "
                               f"({row.kind}), root layer {short(row.root_layer)}"))


@app.command("ls")
def ls(json: JsonOpt = False) -> None:
    """List the images in the store."""
    json_flag(json)
    store = open_store()
    rows = lib.list_images(store)
    data = [{"name": r.name, "kind": r.kind, "root_layer": r.root_layer, "cmdline": r.cmdline, "info": r.info}
            for r in rows]

    def human_view() -> None:
        t = Table("image", "kind", "root layer", "stored")
        for r in rows:
            layer = store.catalogue.layer(r.root_layer)
            t.add_row(r.name, r.kind, short(r.root_layer), human(layer.stored_bytes) if layer else "?")
        console.print(t if rows else "no images yet: `capsule image build tiny tiny`")

    emit(data, human_view)
