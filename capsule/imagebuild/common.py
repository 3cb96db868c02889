"""Shared pieces of the image builders: result type, error type, running tools."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hashcache.errors import Error

MARKER = "CAPSULE-GUEST-READY"
"""Line a Capsule guest prints on its serial console once it is up."""

Progress = Callable[[str], None]

AGENT_SOURCE_DIR = Path(__file__).resolve().parents[2] / "guest-balloon"
"""guest-balloon/ of the repository: the agent's C sources and the Makefile that builds capsule-agent from them."""
AGENT_ENV = "CAPSULE_AGENT_BINARY"
"""Environment variable naming a prebuilt agent binary to use instead of building one."""
AGENT_PORT = "org.capsule.agent.0"
"""The virtio-serial port name the guest agent listens on."""


class ImageBuildError(Error):
    """An image build failed; the message says which step and shows the tail of the tool's output."""

    code = "image_build_failed"
    exit_code = 7


@dataclass
class BuiltImage:
    kind: str  # "tiny" | "debian" | "desktop"
    kernel: Path  # vmlinuz
    initrd: Path  # initramfs / initrd.img
    disk_raw: Path  # raw root disk (no partition table), sparse
    cmdline: str  # kernel command line to boot with
    marker: str  # line the guest prints on the serial console when it is up
    info: dict = field(default_factory=dict)  # kernel version, packages, sizes, timings


def say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


def tail(text: str | bytes, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)


def run(
    cmd: Sequence[str | os.PathLike[str]],
    what: str,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input: bytes | None = None,
    timeout: float | None = None,
    hint: str = "",
) -> subprocess.CompletedProcess[bytes]:
    """Run a tool, capturing its output; raise ImageBuildError with the stderr tail on failure."""
    args = [str(a) for a in cmd]
    full_env = None
    if env is not None:
        full_env = dict(os.environ)
        full_env.update(env)
    try:
        proc = subprocess.run(
            args, cwd=cwd, env=full_env, input=input, capture_output=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise ImageBuildError(
            f"{what}: cannot run {args[0]!r}: not installed or not on PATH" + (f" ({hint})" if hint else "")
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise ImageBuildError(
            f"{what}: `{shlex.join(args)}` did not finish within {timeout:.0f} s\n"
            f"--- stderr tail ---\n{tail(exc.stderr or b'')}"
        ) from exc
    if proc.returncode != 0:
        out = proc.stderr if proc.stderr.strip() else proc.stdout
        raise ImageBuildError(
            f"{what}: `{shlex.join(args)}` exited with status {proc.returncode}"
            + (f"\nhint: {hint}" if hint else "")
            + f"\n--- output tail ---\n{tail(out)}"
        )
    return proc


def run_streaming(
    cmd: Sequence[str | os.PathLike[str]],
    what: str,
    log_path: Path,
    *,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    hint: str = "",
) -> None:
    """Run a long tool, writing all its output to log_path and passing each line to on_line."""
    args = [str(a) for a in cmd]
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    last: collections.deque[str] = collections.deque(maxlen=40)
    try:
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
        )
    except FileNotFoundError as exc:
        raise ImageBuildError(
            f"{what}: cannot run {args[0]!r}: not installed or not on PATH" + (f" ({hint})" if hint else "")
        ) from exc
    assert proc.stdout is not None
    try:
        with log_path.open("w", encoding="utf-8") as log:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                last.append(line)
                if on_line is not None:
                    on_line(line)
        rc = proc.wait()
    except BaseException:
        # let the tool clean up (mmdebstrap unmounts /proc, /sys, /dev in its chroot) before we go on
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if rc != 0:
        raise ImageBuildError(
            f"{what}: `{shlex.join(args)}` exited with status {rc} (full log: {log_path})"
            + (f"\nhint: {hint}" if hint else "")
            + "\n--- output tail ---\n"
            + "\n".join(last)
        )


def cache_dir(workdir: Path) -> Path:
    """Download cache: $CAPSULE_IMAGE_CACHE, else workdir/../cache."""
    env = os.environ.get("CAPSULE_IMAGE_CACHE")
    d = Path(env) if env else workdir.resolve().parent / "cache"
    d.mkdir(parents=True, exist_ok=True)
    return d


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise ImageBuildError(f"{what} must run as root (it needs chroot and file ownership)")


def file_size_info(path: Path) -> dict[str, int]:
    """Apparent size and bytes actually allocated (for sparse files)."""
    st = path.stat()
    return {"bytes": st.st_size, "allocated_bytes": st.st_blocks * 512}


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.laps: dict[str, float] = {}
        self._last = self.t0

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self._last, 2)
        self._last = now

    def total(self) -> float:
        return round(time.monotonic() - self.t0, 2)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path (from /proc/self/mountinfo), deepest first."""
    base = os.path.realpath(path)
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        mp = line.split()[4].encode().decode("unicode_escape")
        if mp == base or mp.startswith(base.rstrip("/") + "/"):
            found.append(mp)
    return sorted(found, key=len, reverse=True)


def safe_rmtree(path: Path) -> None:
    """Remove a work directory, but never through a mount left behind inside it (e.g. a chroot's /dev)."""
    left = mounts_under(path)
    for mp in left:
        subprocess.run(["umount", "--lazy", mp], capture_output=True, check=False)
    left = mounts_under(path)
    if left:
        raise ImageBuildError(f"not removing {path}: still mounted inside it: {', '.join(left)}; unmount by hand")
    shutil.rmtree(path, ignore_errors=True)


def is_static_elf(path: Path) -> bool:
    """True for an x86-64 (ELF64) executable without a program interpreter (PT_INTERP)."""
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        (phoff,) = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))  # PT_INTERP


def _agent_build_hint(output: str) -> str:
    if re.search(r"\bgcc: (command )?not found|\bgcc: No such file or directory", output):
        return "gcc is not installed: install the Debian packages gcc and libc6-dev"
    if re.search(r"cannot find -lc\b|cannot find -lc:|\.h: No such file or directory", output):
        return "the static C library (libc.a) or the C headers are missing: install the Debian package libc6-dev"
    return "building the agent needs make, gcc and the static glibc (Debian packages make, gcc, libc6-dev)"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``directory`` itself, so no lock file is left behind."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def agent_sources(source_dir: Path) -> list[Path]:
    """The guest agent's source files: every ``*.c`` and ``*.h`` directly in ``source_dir``
    (its ``fuzz/`` harness is not part of the agent)."""
    return sorted(p for pattern in ("*.c", "*.h") for p in source_dir.glob(pattern) if p.is_file())


def agent_binary(progress: Progress | None = None, source_dir: Path | None = None) -> Path:
    """The static guest agent binary (capsule-agent), built with `make -C guest-balloon` if it is
    missing or older than any of its sources (``agent_sources``).  $CAPSULE_AGENT_BINARY names a
    prebuilt one instead."""
    env = os.environ.get(AGENT_ENV)
    if env and source_dir is None:
        binary = Path(env)
        if not binary.is_file():
            raise ImageBuildError(f"${AGENT_ENV}={env}: no such file")
        if not is_static_elf(binary):
            raise ImageBuildError(f"${AGENT_ENV}={env}: not a static x86-64 ELF executable")
        return binary
    src_dir = Path(source_dir) if source_dir is not None else AGENT_SOURCE_DIR
    binary = src_dir / "capsule-agent"
    if not any(p.suffix == ".c" for p in agent_sources(src_dir)):
        raise ImageBuildError(
            f"the guest agent sources (*.c in {src_dir}) are missing (a Capsule checkout has them), "
            f"or set ${AGENT_ENV} to a prebuilt capsule-agent"
        )
    with _locked(src_dir):  # one build at a time (concurrent image builds)
        newest = max((p.stat().st_mtime for p in agent_sources(src_dir)), default=0.0)
        if not binary.is_file() or binary.stat().st_mtime < newest:
            say(progress, f"building the guest agent: make -C {src_dir}")
            try:
                proc = subprocess.run(["make", "-C", str(src_dir)], capture_output=True, timeout=600, check=False)
            except FileNotFoundError as exc:
                raise ImageBuildError(
                    "building the guest agent: `make` is not installed: "
                    "install the Debian packages make, gcc and libc6-dev"
                ) from exc
            if proc.returncode != 0 or not binary.is_file():
                out = (proc.stdout + proc.stderr).decode("utf-8", "replace")
                raise ImageBuildError(
                    f"building the guest agent: `make -C {src_dir}` exited with status {proc.returncode}\n"
                    f"hint: {_agent_build_hint(out)}\n--- output tail ---\n{tail(out)}"
                )
    if not is_static_elf(binary):
        raise ImageBuildError(f"{binary} is not a static x86-64 executable; run `make -C {src_dir} clean` and retry")
    return binary


def agent_info(binary: Path) -> dict[str, object]:
    """Version, protocol, sha256 and size of an agent binary (it is run with --version)."""
    data = binary.read_bytes()
    proc = run([binary, "--version"], f"run {binary} --version", timeout=30)
    out = proc.stdout.decode("utf-8", "replace").strip()
    m = re.fullmatch(r"capsule-agent (\S+) \(protocol (\d+)\)", out)
    if not m:
        raise ImageBuildError(f"{binary} --version printed {out!r}, not 'capsule-agent VERSION (protocol N)'")
    return {
        "version": m.group(1),
        "protocol": int(m.group(2)),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }


POD_LAYER_SOURCE = Path(__file__).resolve().parents[2] / "pods"
POD_LAYER_PATH = "/usr/lib/python3/dist-packages/pods"  # on every python3 of Debian's path


def pod_layer_files() -> list[Path]:
    """The pod layer's sources (``pods/*.py``), the files installed into the Debian guest."""
    files = sorted(POD_LAYER_SOURCE.glob("*.py"))
    if not files:
        raise ImageBuildError(f"the pod layer's sources are missing ({POD_LAYER_SOURCE})")
    return files


def recipe_sha256() -> str:
    """One digest over the image recipes' sources (this package): an image built by other recipes is stale
    for the tests' image cache (a changed package list, initrd rule or guest file means another image)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def pod_layer_sha256() -> str:
    """One digest over the pod layer's file names and contents: an image holding another is stale."""
    h = hashlib.sha256()
    for f in pod_layer_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
