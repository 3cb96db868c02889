"""The map the native read path serves hits from (diskserver/fastread/: an nbdkit filter in front of the
Python plugin). The plugin writes it once, when it has opened the chain: the segment map (which layer
owns each run of blocks, and for a local layer where the run starts in its qcow2 file), each layer's
files (a local layer's qcow2 file; a remote layer's shadow data and presence bitmap), and a shared region
both processes' threads write without locks: the filter's hit counters and the read-ahead state.

Layout (little-endian; fastread.c has the same as C structs)::

    0     magic "CAPSFM01", size, nblocks, nlayers, nseg, ra_min, ra_max, 0     (8 × u64)
    64    counters: requests, guest_bytes, zero_blocks, local_blocks, shadow_blocks, passed, 0, 0
    128   read-ahead: window (i64), pos (u64), ends[8] (u64; 2**64-1: none)
    256   nlayers × 2048: kind (0 pass, 1 local, 2 shadow), bitmap header bytes, nblocks,
          data path (1000 bytes, NUL-terminated), bitmap path (1024 bytes, NUL-terminated)
    …     nseg × 24: start block (u64), owner (i64; -1: zeros), host offset (u64)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from diskserver.errors import DiskServerError
from hashcache.atomic import write_atomic
from hashcache.shadow import _HDR as SHADOW_HEADER

if TYPE_CHECKING:
    from diskserver.chain.facade import Chain
    from diskserver.chain.spec import ReadaheadSpec

MAGIC = b"CAPSFM01"
HEADER = 256
LAYER = 2048
DATA_PATH = 1000
BITMAP_PATH = 1024
SEG = 24
RING = 8
NO_END = (1 << 64) - 1
KIND_PASS, KIND_LOCAL, KIND_SHADOW = 0, 1, 2
COUNTERS = ("requests", "guest_bytes", "zero_blocks", "local_blocks", "shadow_blocks", "passed")
_COUNTERS_AT = 64
_WINDOW_AT = 128
_POS_AT = 136
_ENDS_AT = 144


def _path_field(path: Path | str, size: int) -> bytes | None:
    raw = os.fsencode(os.path.abspath(path))
    return raw + bytes(size - len(raw)) if len(raw) < size else None


def _layer_record(chain: Chain, pos: int) -> bytes:
    """One layer's record; a layer whose paths do not fit is left to the plugin (kind 0)."""
    layer = chain.layers[pos]
    if layer.local:
        data = _path_field(layer.spec.local_path, DATA_PATH)  # type: ignore[arg-type]
        bitmap, kind, header = bytes(BITMAP_PATH), KIND_LOCAL, 0
    else:
        assert layer.shadow is not None
        data = _path_field(layer.shadow.data_path, DATA_PATH)
        bitmap = _path_field(layer.shadow.bitmap_path, BITMAP_PATH)  # type: ignore[assignment]
        kind, header = KIND_SHADOW, SHADOW_HEADER
    if data is None or bitmap is None:
        return struct.pack("<3Q", KIND_PASS, 0, 0) + bytes(LAYER - 24)
    return struct.pack("<3Q", kind, header, layer.nblocks) + data + bitmap


def _segments(chain: Chain) -> bytes:
    starts, owners, hosts = chain._seg_start, chain._seg_owner, chain._seg_host
    out = array("q", bytes(8 * 3 * len(starts)))
    out[0::3] = starts
    out[1::3] = array("q", owners)
    out[2::3] = hosts
    return out.tobytes()


class FastMap:
    """The written map, mapped shared: the filter's counters and the read-ahead state both sides keep."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm

    @classmethod
    def write(cls, path: str | os.PathLike[str], chain: Chain) -> FastMap:
        """Write the map of the open ``chain`` at ``path`` (atomically: the filter never sees half of it)."""
        path = Path(path)
        ra = chain.spec.readahead
        head = struct.pack("<8s7Q", MAGIC, chain.size, chain.nblocks, len(chain.layers), len(chain._seg_start),
                           ra.min_blocks, ra.max_blocks, 0)
        head += bytes(_WINDOW_AT - len(head)) + struct.pack("<qQ", 0, 0) + struct.pack(f"<{RING}Q", *[NO_END] * RING)
        body = head + bytes(HEADER - len(head))
        body += b"".join(_layer_record(chain, pos) for pos in range(len(chain.layers))) + _segments(chain)
        try:
            write_atomic(path, body, durable=False, mode=0o600)  # the filter never sees half of it
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, len(body))
            finally:
                os.close(fd)
        except OSError as exc:
            raise DiskServerError(f"cannot write the native read path's map {path}: {exc.strerror or exc}") from exc
        return cls(path, mm)

    def counters(self) -> dict[str, int]:
        values = struct.unpack_from(f"<{len(COUNTERS)}Q", self._mm, _COUNTERS_AT)
        return dict(zip(COUNTERS, values, strict=True))

    def note(self, first: int, end: int, ra: ReadaheadSpec) -> int:
        """The read-ahead window for a request the plugin serves (``ReadaheadSpec.window``, on the shared
        state the filter's hits also advance)."""
        mm = self._mm
        sequential = first in struct.unpack_from(f"<{RING}Q", mm, _ENDS_AT)
        window = ra.window(sequential, struct.unpack_from("<q", mm, _WINDOW_AT)[0])
        struct.pack_into("<q", mm, _WINDOW_AT, window)
        pos = struct.unpack_from("<Q", mm, _POS_AT)[0]
        struct.pack_into("<Q", mm, _POS_AT, pos + 1)
        struct.pack_into("<Q", mm, _ENDS_AT + 8 * (pos % RING), end)
        return window

    def close(self) -> None:
        """Unmap and remove the file (a filter that has it mapped keeps reading its copy)."""
        with contextlib.suppress(OSError, ValueError, BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
