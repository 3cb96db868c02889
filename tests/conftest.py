"""Shared fixtures: an image store built once per machine (tiny, and Debian
on demand), fresh per-test stores that import those images, and clean-up of
every libvirt domain a test store started."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers import check_tiers, no_processes

ROOT = Path(__file__).resolve().parent.parent
IMAGE_HOME = Path(os.environ.get("CAPSULE_TEST_IMAGES", ROOT / ".cache" / "test-images"))


def pytest_collection_modifyitems(config, items):
    check_tiers(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    yield from no_processes(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    yield from no_processes(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from no_processes(item)


def _image_store():
    from capsule.store import Store

    return Store.open(IMAGE_HOME)


def _ensure_image(store, kind: str) -> None:
    """Build the image once; again when the guest agent it carries is not the current one."""
    from capsule import images
    from capsule.imagebuild.common import agent_binary, agent_info

    row = store.catalogue.image(kind)
    stale = row is not None and row.info.get("agent_sha256") != agent_info(agent_binary())["sha256"]
    images.build(store, kind, kind, rebuild=stale)


@pytest.fixture(scope="session")
def tiny_images():
    """The machine-wide test image store, with the tiny image built."""
    store = _image_store()
    _ensure_image(store, "tiny")
    return store


@pytest.fixture(scope="session")
def debian_images(tiny_images):
    _ensure_image(tiny_images, "debian")
    return tiny_images


def _destroy_domains(store) -> None:
    import libvirt

    from capsule.runtime.connection import connect

    conn = connect()
    for dom in conn.listAllDomains():
        if dom.name().startswith(f"capsule-{store.id}-"):
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()


def make_store(path: Path, source, *images_to_import: str):
    from capsule import images
    from capsule.store import Store

    store = Store.open(path)
    for name in images_to_import:
        images.import_image(source, store, name)
    return store


@pytest.fixture
def store(tmp_path, tiny_images) -> Iterator:
    """A fresh store holding the tiny image."""
    s = make_store(tmp_path / "store", tiny_images, "tiny")
    yield s
    _destroy_domains(s)
    s.close()


@pytest.fixture
def debian_store(tmp_path, debian_images) -> Iterator:
    s = make_store(tmp_path / "store", debian_images, "debian", "tiny")
    yield s
    _destroy_domains(s)
    s.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """``capsule serve`` for one store, in its own process."""

    def __init__(self, home: Path, token_file: Path, port: int | None = None) -> None:
        import subprocess
        import sys
        import time

        import httpx

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.token_file = token_file
        # The agent's log goes to a file (a pipe nobody reads would stall it once full); stop()
        # prints it, so a failing test shows the agent's side too.
        self.log_path = token_file.with_suffix(".log")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "capsule.cli.main", "--home", str(home), "serve", "--listen",
                 f"127.0.0.1:{self.port}", "--token-file", str(token_file)],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                if token_file.exists():
                    r = httpx.get(f"{self.url}/v1/info", headers={"Authorization": f"Bearer {self.token}"})
                    if r.status_code == 200:
                        break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not start: {self.log()}")
            time.sleep(0.1)

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                os.killpg(self.proc.pid, signal.SIGKILL)
        if text := self.log().strip():
            print(f"--- agent {self.url} log ---\n{text}")


@pytest.fixture
def two_hosts(tmp_path, tiny_images):
    """Hosts A and B: two stores (both holding the tiny image) and two agents on loopback."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images, "tiny")
    agent_a = Agent(a.home, tmp_path / "a.token")
    agent_b = Agent(b.home, tmp_path / "b.token")
    yield a, b, agent_a, agent_b
    for agent in (agent_a, agent_b):
        agent.stop()
    for s in (a, b):
        _destroy_domains(s)
        s.close()
