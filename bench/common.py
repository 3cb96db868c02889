"""Shared benchmark plumbing: JSON results, a short table, and stores holding the tiny test image."""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from testkit.images import IMAGE_HOME

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def workdir(prefix: str) -> Path:
    """A new private work directory (``mkdtemp``) that QEMU, an unprivileged user, may pass through to the
    stores in it (``guestaccess.let_pass``)."""
    from capsule.runtime.guestaccess import let_pass

    path = Path(tempfile.mkdtemp(prefix=prefix))
    let_pass(path, Path(tempfile.gettempdir()))
    return path


@contextlib.contextmanager
def temp_workdir(prefix: str) -> Iterator[Path]:
    """:func:`workdir`, removed on the way out."""
    path = workdir(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def image_stores(kind: str, *paths: Path) -> list[Any]:
    """New stores at ``paths``, each holding the test image of ``kind`` (tiny, debian, …), built once into
    the test images store (testkit.images.IMAGE_HOME) if it is not there yet."""
    from capsule import images
    from capsule.store import Store

    src = Store.open(IMAGE_HOME)
    images.build(src, kind, kind)
    stores = [Store.open(p) for p in paths]
    for s in stores:
        images.import_image(src, s, kind)
    return stores


def tiny_stores(*paths: Path) -> list[Any]:
    """New stores at ``paths``, each holding the tiny image."""
    return image_stores("tiny", *paths)


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    data = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    Console().print(t)


def median(xs: list[float]) -> float:
    return statistics.median(xs)
