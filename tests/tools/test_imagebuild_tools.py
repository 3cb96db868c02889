"""Image building helpers that run host tools: cpio, make and the C compiler."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from capsule.imagebuild.common import (
    AGENT_SOURCE_DIR,
    ImageBuildError,
    agent_binary,
    agent_info,
    agent_sources,
    is_static_elf,
    run,
)
from capsule.imagebuild.cpio import CpioWriter

pytestmark = pytest.mark.tools


@pytest.mark.skipif(shutil.which("cpio") is None, reason="needs cpio")
def test_cpio_newc_is_readable_by_cpio(tmp_path: Path) -> None:
    w = CpioWriter()
    w.add_file("bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
    w.add_symlink("usr/bin/tool", "/bin/tool")
    w.add_chardev("dev/console", 5, 1)
    w.add_dir("tmp", 0o1777)
    data = w.render()
    assert len(data) % 512 == 0
    names = subprocess.run(["cpio", "-it", "--quiet"], input=data, capture_output=True, check=True).stdout
    assert names.decode().split() == [
        "bin",
        "bin/tool",
        "usr",
        "usr/bin",
        "usr/bin/tool",
        "dev",
        "dev/console",
        "tmp",
    ]
    listing = subprocess.run(["cpio", "-itv", "--quiet"], input=data, capture_output=True, check=True).stdout.decode()
    assert "crw-------" in listing and "-> /bin/tool" in listing
    assert "drwxrwxrwt" in listing
    assert w.render() == data  # deterministic


def test_run_reports_stderr_tail() -> None:
    with pytest.raises(ImageBuildError) as e:
        run(["sh", "-c", "echo first >&2; echo the-real-reason >&2; exit 3"], "demo step")
    msg = str(e.value)
    assert "demo step" in msg and "status 3" in msg and "the-real-reason" in msg
    with pytest.raises(ImageBuildError, match="not installed"):
        run(["capsule-no-such-tool-xyz"], "demo step")


needs_cc = pytest.mark.skipif(
    not (shutil.which("make") and shutil.which("gcc")), reason="needs make and gcc (and libc6-dev)"
)


def _agent_tree(tmp_path: Path) -> Path:
    d = tmp_path / "guest-balloon"
    (d / "fuzz").mkdir(parents=True)
    harness = AGENT_SOURCE_DIR / "fuzz" / "fuzz_request.c"
    for src in [*agent_sources(AGENT_SOURCE_DIR), AGENT_SOURCE_DIR / "Makefile", harness]:
        shutil.copy2(src, d / src.relative_to(AGENT_SOURCE_DIR))
    return d


def _age(path: Path, seconds: float, now: float) -> None:
    os.utime(path, (now - seconds, now - seconds))


@needs_cc
@pytest.mark.timeout(300)
def test_agent_binary_builds_when_missing_or_stale(tmp_path: Path) -> None:
    d = _agent_tree(tmp_path)
    msgs: list[str] = []
    binary = agent_binary(msgs.append, source_dir=d)
    assert binary == d / "capsule-agent" and is_static_elf(binary)
    assert any("make -C" in m for m in msgs)
    info = agent_info(binary)
    assert info["protocol"] == 1 and info["bytes"] == binary.stat().st_size
    assert info["sha256"] == hashlib.sha256(binary.read_bytes()).hexdigest()
    # up to date: no build
    msgs.clear()
    assert agent_binary(msgs.append, source_dir=d) == binary and msgs == []
    # any one source newer than the binary, a header as much as a .c file: built again
    for newer in ("main.c", "agent.h"):
        now = binary.stat().st_mtime
        for src in agent_sources(d):
            _age(src, 200, now)
        _age(binary, 100, now)
        _age(d / newer, 0, now)
        msgs.clear()
        assert agent_binary(msgs.append, source_dir=d) == binary and msgs, newer
        assert binary.stat().st_mtime >= (d / newer).stat().st_mtime
    # the fuzz harness is not the agent: a newer one builds nothing
    _age(d / "fuzz" / "fuzz_request.c", -100, binary.stat().st_mtime)
    msgs.clear()
    assert agent_binary(msgs.append, source_dir=d) == binary and msgs == []


def _failing_tree(tmp_path: Path, recipe: str) -> Path:
    d = tmp_path / "guest-balloon"
    d.mkdir(parents=True)
    (d / "agent.c").write_text("int main(void) { return 0; }\n")
    (d / "Makefile").write_text(f"capsule-agent: agent.c\n\t{recipe}\n")
    return d


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_agent_build_failure_names_the_debian_package(tmp_path: Path) -> None:
    d = _failing_tree(tmp_path / "a", "@echo '/usr/bin/ld: cannot find -lc: No such file or directory' >&2; exit 1")
    with pytest.raises(ImageBuildError, match="libc6-dev") as e:
        agent_binary(source_dir=d)
    assert "guest agent" in str(e.value) and "cannot find -lc" in str(e.value)
    d = _failing_tree(tmp_path / "b", "capsule-no-such-gcc-xyz -o $@ agent.c")
    with pytest.raises(ImageBuildError, match="make, gcc and the static glibc"):
        agent_binary(source_dir=d)
    d = _failing_tree(tmp_path / "c", "@echo 'make: gcc: No such file or directory' >&2; exit 2")
    with pytest.raises(ImageBuildError, match="gcc is not installed"):
        agent_binary(source_dir=d)

