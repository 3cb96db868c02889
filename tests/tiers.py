"""Test tiers, made explicit and checked.

Every test carries exactly one tier marker (a module's ``pytestmark`` or a decorator):

- ``unit``: in-process only, no images, fast. Checked: a unit test that asks for an image
  fixture fails collection, and one that starts a process (subprocess, fork, spawn) fails
  with a message naming the tier to use instead. Each unit test gets a 60 s timeout.
- ``tools``: starts real processes on small local files (qemu-img, nbdkit, a compiler, an
  agent) and may copy the tiny test image; boots no guest.
- ``vm``: boots real QEMU guests through libvirt.
- ``hosts``: separate hosts (docker compose).
- ``browser``: drives real Chromium.

A test file lives in the folder of its tier (``tests/unit/``, ``tests/tools/``, ``tests/vm/``,
``tests/hosts/``, ``tests/browser/``): a ``tools`` test under ``tests/unit/`` fails collection with a
message naming the folder it belongs in. Helpers several tiers import live in ``tests/helpers/`` (and
what the benchmarks share, in ``testkit/``).

``slow`` is not a tier: it adds to one. Every other test has the default timeout from
``[tool.pytest.ini_options] timeout``; a test that needs longer says so with
``@pytest.mark.timeout(N)``."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

TIERS = ("unit", "tools", "vm", "hosts", "browser")
TESTS = Path(__file__).resolve().parent
UNIT_TIMEOUT = 60.0
# fixtures that need the test image store: a test asking for one is not a unit test
IMAGE_FIXTURES = frozenset({"tiny_images", "debian_images", "desktop_images", "store", "debian_store",
                            "desktop_store", "two_hosts"})


def _image_fixtures_used(item: pytest.Item) -> set[str]:
    """The image fixtures ``item`` really uses: a module may define its own ``store`` fixture (a bare
    store in tmp_path), which is not the shared conftest fixture of the same name."""
    used = set()
    info = getattr(item, "_fixtureinfo", None)
    for name in IMAGE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        closest = defs[-1] if defs else None
        if closest is None or getattr(closest.func, "__module__", "") == "tests.conftest":
            used.add(name)
    return used


def tier_of(item: pytest.Item) -> list[str]:
    return [t for t in TIERS if item.get_closest_marker(t) is not None]


def folder_of(item: pytest.Item) -> str | None:
    """The folder of tests/ that holds ``item``'s file ("" for a file directly in tests/), None for a file
    outside tests/."""
    path = getattr(item, "path", None)
    if path is None:
        return None
    try:
        parts = Path(path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else ""


def check_tiers(items: list[pytest.Item]) -> None:
    """Give unit tests their short timeout; fail collection on a test without exactly one tier, a test
    outside its tier's folder, or a unit test that needs images."""
    problems = []
    for item in items:
        tiers = tier_of(item)
        if len(tiers) != 1:
            got = ", ".join(tiers) or "none"
            problems.append(f"{item.nodeid}: needs exactly one tier marker of {', '.join(TIERS)} (has {got})")
            continue
        folder = folder_of(item)
        if folder is not None and folder != tiers[0]:
            problems.append(f"{item.nodeid}: marked {tiers[0]} but lives in tests/{folder + '/' if folder else ''}: "
                            f"move its file to tests/{tiers[0]}/ (a test's folder is its tier)")
        if tiers == ["unit"]:
            images = _image_fixtures_used(item)
            if images:
                problems.append(f"{item.nodeid}: marked unit but uses the image fixture(s) "
                                f"{', '.join(sorted(images))}: mark it tools or vm")
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT))
    if problems:
        raise pytest.UsageError("test tiers are wrong:\n  " + "\n  ".join(problems))


class ProcessStarted(AssertionError):
    pass


def _refuse(*_args, **_kwargs):
    raise ProcessStarted("a unit test started a process: unit tests run in-process only; "
                         "mark the test `tools` (or `vm`), or give it an in-memory fake")


_PATCHES = ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "forkpty"),
            (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"), (os, "execv"), (os, "execve"))


def no_processes(item: pytest.Item) -> Iterator[None]:
    """Around a unit test's setup, call and teardown: any attempt to start a process fails."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    saved = [(mod, name, getattr(mod, name)) for mod, name in _PATCHES if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, _refuse)
    try:
        yield
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)
