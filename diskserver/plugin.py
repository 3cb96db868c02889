"""nbdkit Python plugin: export a flattened layer chain read-only (the demand-paging disk server, §4.3).

Run as::

    nbdkit --foreground --readonly --unix SOCKET python /REPO/diskserver/plugin.py spec=CHAIN.json \
        [site_packages=DIR] [prefetch=true|false]

nbdkit embeds the system's ``python3`` (Debian's 3.11), not the project's virtualenv, so before importing
any project code this file puts on ``sys.path``:

* the project root (the parent of this file's directory), for ``diskserver`` and ``hashcache``;
* the virtualenv's site-packages, for ``blake3``, ``zstandard``, ``httpx``: the ``site_packages=``
  parameter if given, else ``$CAPSULE_SITE_PACKAGES``, else ``<repo>/.venv/lib/pythonX.Y/site-packages``.
  It must have been built for the same Python minor version (same ABI); a mismatch is refused with a
  clear message.

The chain is opened in ``after_fork`` (after nbdkit has daemonised, if it does, so that no thread or
SQLite handle crosses a fork); nbdkit exits with the error if it cannot be opened. Errors of ``pread``
are logged to stderr (nbdkit's log) and reported to the client as EIO (EINVAL for bad ranges).
Thread model: parallel — reads of local blocks run concurrently; misses are coordinated by the chain.

In front of it the server puts the native read path (``--filter=diskserver/fastread/capsule-fastread.so``,
built by ``make native``): it passes ``fastmap=SPEC.fastmap``, this plugin writes the chain's map there
once the chain is open, and the filter serves every read whose blocks are all local, zero or already in
their shadows without calling into Python; the rest comes here whole (diskserver/chain/fastmap.py).
"""

from __future__ import annotations

import errno
import logging
import os
import site
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported for real once the paths are set up (below)
    from diskserver.chain import Chain

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _add_site_packages(path: str, origin: str) -> None:
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise RuntimeError(f"diskserver plugin: site-packages {path} (from {origin}) does not exist")
    parts = path.split(os.sep)
    versions = [p for p in parts if p.startswith("python3.")]
    if versions and versions[-1] != _PYVER:
        raise RuntimeError(
            f"diskserver plugin: site-packages {path} (from {origin}) is for {versions[-1]}, but nbdkit embeds "
            f"{_PYVER}; create the virtualenv with the system's {_PYVER}")
    if path not in sys.path:
        site.addsitedir(path)  # also processes .pth files (editable installs)
        sys.path.remove(path)
        sys.path.insert(1, path)


def _setup_paths() -> None:
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    env = os.environ.get("CAPSULE_SITE_PACKAGES")
    if env:
        _add_site_packages(env, "$CAPSULE_SITE_PACKAGES")
        return
    default = os.path.join(_ROOT, ".venv", "lib", _PYVER, "site-packages")
    if os.path.isdir(default):
        _add_site_packages(default, "the project's .venv")


_setup_paths()

import nbdkit  # noqa: E402  (provided by nbdkit's python plugin)

API_VERSION = 2

_spec_path: str | None = None
_fastmap_path: str | None = None  # given by the native read path's filter (diskserver/fastread/)
_prefetch_override: bool | None = None
_chain: Chain | None = None  # once opened
_prefetch_stop = threading.Event()
_prefetch_thread: threading.Thread | None = None
PREFETCH_RESUME_FIRST = 2.0  # seconds before a prefetch paused by an unreachable source tries again, doubling
PREFETCH_RESUME_MAX = 60.0
log = logging.getLogger("diskserver")


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s diskserver[%(process)d] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _bool(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}={value!r}: expected true or false")


def config(key: str, value: str) -> None:
    global _spec_path, _prefetch_override, _fastmap_path
    if key == "spec":
        _spec_path = os.path.abspath(value)
    elif key == "fastmap":
        _fastmap_path = os.path.abspath(value)
    elif key == "site_packages":
        _add_site_packages(value, "site_packages=")
    elif key == "prefetch":
        _prefetch_override = _bool(key, value)
    else:
        raise ValueError(f"diskserver plugin: unknown parameter {key}={value!r} "
                         "(known: spec, site_packages, prefetch, fastmap)")


def config_complete() -> None:
    _setup_logging()
    if _spec_path is None:
        raise ValueError("diskserver plugin: spec=CHAIN.json is required")
    from diskserver.chain import ChainSpec

    ChainSpec.load(_spec_path)  # fail at startup on a malformed spec


def thread_model() -> int:
    return nbdkit.THREAD_MODEL_PARALLEL


def after_fork() -> None:
    global _chain, _prefetch_thread
    from diskserver.chain import Chain, ChainSpec

    assert _spec_path is not None  # config_complete refused to go on without one
    spec = ChainSpec.load(_spec_path)
    try:
        _chain = chain = Chain.open(spec)
    except Exception as exc:
        log.error("cannot open the chain of %s: %s", _spec_path, exc)
        raise
    if _fastmap_path is not None:
        try:
            chain.attach_fastmap(_fastmap_path)
        except Exception as exc:  # the native path is a speed-up: without its map this plugin serves every read
            log.warning("%s; every read goes through the plugin", exc)
    log.info("serving %s: %d layer(s), %d bytes, %d remote byte(s) still to fetch%s", _spec_path, len(spec.layers),
             chain.size, chain.stats()["remaining_bytes"], "; hits on the native read path" if _fastmap_path else "")
    prefetch = spec.prefetch if _prefetch_override is None else _prefetch_override
    if prefetch:
        _prefetch_thread = threading.Thread(target=_run_prefetch, args=(chain,), name="diskserver-prefetch",
                                            daemon=True)
        _prefetch_thread.start()


def _run_prefetch(chain: Chain) -> None:
    """Pull every remaining block in the background. A source out of reach for its retry window (a busy object
    store, a peer restarting) pauses the prefetch, which resumes after a wait that doubles up to
    ``PREFETCH_RESUME_MAX``: a layer is never left half-paged for good by one outage. Anything else (a wrong
    block, a refused grant) stops it, logged."""
    from diskserver.errors import SourceUnavailable

    delay = PREFETCH_RESUME_FIRST
    while not _prefetch_stop.is_set():
        try:
            n = chain.prefetch(stop_event=_prefetch_stop)
        except SourceUnavailable as exc:
            log.warning("prefetch paused: %s; it resumes in %g s", exc, delay)
            if _prefetch_stop.wait(delay):
                return
            delay = min(delay * 2, PREFETCH_RESUME_MAX)
            continue
        except Exception as exc:  # noqa: BLE001
            log.error("prefetch stopped: %s", exc)
            return
        if not _prefetch_stop.is_set():
            chain.write_stats()
            log.info("prefetch finished: %d block(s) obtained; complete=%s", n, chain.complete())
        return


def cleanup() -> None:
    _prefetch_stop.set()
    if _prefetch_thread is not None:
        _prefetch_thread.join(30)
    if _chain is not None:
        _chain.close()


def open(readonly: bool) -> Chain:  # noqa: A001 - nbdkit's required name
    if _chain is None:
        nbdkit.set_error(errno.EIO)
        raise RuntimeError("diskserver plugin: the chain is not open")
    return _chain


def get_size(h: Chain) -> int:
    return h.size


def can_write(h: Chain) -> bool:
    return False


def can_multi_conn(h: Chain) -> bool:
    return True


def can_extents(h: Chain) -> bool:
    return True


def can_cache(h: Chain) -> int:
    return nbdkit.CACHE_NATIVE


def is_rotational(h: Chain) -> bool:
    return False


def _fail(what: str, exc: Exception) -> None:
    code = errno.EINVAL if isinstance(exc, ValueError) else errno.EIO
    log.error("%s failed: %s", what, exc)
    nbdkit.set_error(code)


def pread(h: Chain, buf: memoryview, offset: int, flags: int) -> None:
    try:
        h.read_into(offset, buf)
    except Exception as exc:
        _fail(f"read of {len(buf)} bytes at offset {offset}", exc)
        raise


def cache(h: Chain, count: int, offset: int, flags: int) -> None:
    try:
        h.cache(offset, count)
    except Exception as exc:
        _fail(f"cache of {count} bytes at offset {offset}", exc)
        raise


def extents(h: Chain, count: int, offset: int, flags: int) -> list[tuple[int, int, int]]:
    zero = nbdkit.EXTENT_HOLE | nbdkit.EXTENT_ZERO
    try:
        return [(o, n, zero if z else 0) for o, n, z in h.extents(offset, count)]
    except Exception as exc:
        _fail(f"extents of {count} bytes at offset {offset}", exc)
        raise
