"""Block hashing: the one definition of what a block's hash is.

A block is ``BLOCK_SIZE`` (4 KiB) bytes. Its hash is BLAKE3 (32 bytes) of the block; a short final
block (end of a file, or a virtual disk whose size is not a multiple of 4 KiB) is zero-padded to
``BLOCK_SIZE`` before hashing, so a block's hash never depends on where the object happens to end.

Throughput, one core (Python 3.11, blake3 1.0.11, x86-64 with AVX2, data in cache):

* ``hash_blocks`` on random data: ~3.4 GB/s (BLAKE3 of one 4 KiB block costs ~1.0 us, so ~3.9 GB/s
  is the ceiling; the per-block Python overhead is ~15%).
* ``scan_blocks`` on random data: ~3.2 GB/s; on all-zero data ~28 GB/s (the zero test is a memcmp
  via ``bytes.startswith`` on a preallocated zero block, ~20x cheaper than hashing).
* ``manifest_of_file`` (pread into a reused 8 MiB buffer + ``scan_blocks``), 256 MiB random file in
  the page cache: ~1.9 GB/s; ``manifest_of_layer`` on a fully allocated 1 GiB qcow2: ~1.5-1.7 GB/s.

The loops are list comprehensions over memoryview slices with the bound methods hoisted into locals:
the cheapest per-block path pure Python offers (``map`` chains and ``bytes`` slices measured no
better). ``bench/hashing.py`` reproduces the numbers.

``hash_blocks`` and ``scan_blocks`` now run in the compiled extension (:mod:`hashcache.native`: GIL
released, both cores); the pure-Python loops above stay as ``py_hash_blocks`` / ``py_scan_blocks``,
the reference the extension is tested against (``tests/unit/test_native_blocks.py``).
"""

from __future__ import annotations

from blake3 import blake3

from hashcache import native

#: Anything the hashing functions accept.
BytesLike = bytes | bytearray | memoryview

BLOCK_SIZE = 4096
ALGORITHM = "blake3"
HASH_SIZE = 32

ZERO_BLOCK = bytes(BLOCK_SIZE)
#: The 32 zero bytes a manifest stores in place of a zero block's hash.
NULL_HASH = bytes(HASH_SIZE)

_zero_prefix = ZERO_BLOCK.startswith  # ZERO_BLOCK.startswith(x) <=> x is all zero (len(x) <= BLOCK_SIZE)


def hash_block(data: BytesLike) -> bytes:
    """BLAKE3 of one block (at most ``BLOCK_SIZE`` bytes; a shorter block is zero-padded)."""
    view = memoryview(data).cast("B")
    n = len(view)
    if n == BLOCK_SIZE:
        return blake3(view).digest()
    if n > BLOCK_SIZE:
        raise ValueError(f"hash_block: got {n} bytes, a block is at most {BLOCK_SIZE}")
    return blake3(bytes(view) + ZERO_BLOCK[n:]).digest()


def is_zero(data: BytesLike) -> bool:
    """True if every byte of ``data`` (any length) is zero."""
    view = memoryview(data).cast("B")
    if len(view) <= BLOCK_SIZE:
        return _zero_prefix(view)
    return all(map(_zero_prefix, _slices(view)))


def _slices(view: memoryview) -> list[memoryview]:
    """Split a byte view into BLOCK_SIZE slices, the last one zero-padded to a full block if short."""
    n = len(view)
    full = n - n % BLOCK_SIZE
    out = [view[o : o + BLOCK_SIZE] for o in range(0, full, BLOCK_SIZE)]
    if full != n:
        out.append(memoryview(bytes(view[full:]) + ZERO_BLOCK[n - full :]))
    return out


def _as_view(buf: BytesLike, length: int | None) -> memoryview:
    view = memoryview(buf).cast("B")
    if length is not None:
        if not 0 <= length <= len(view):
            raise ValueError(f"length {length} outside buffer of {len(view)} bytes")
        view = view[:length]
    return view


def py_hash_blocks(buf: BytesLike, length: int | None = None) -> list[bytes]:
    """Reference (pure Python) of :func:`hash_blocks`.

    Hash every block of ``buf[:length]``; the last block is zero-padded if short.

    Returns one 32-byte hash per block, in order (``ceil(length / BLOCK_SIZE)`` of them).
    """
    view = _as_view(buf, length)
    n = len(view)
    full = n - n % BLOCK_SIZE
    h = blake3
    out = [h(view[o : o + BLOCK_SIZE]).digest() for o in range(0, full, BLOCK_SIZE)]
    if full != n:
        out.append(hash_block(view[full:]))
    return out


def py_scan_blocks(buf: BytesLike, length: int | None = None) -> list[bytes | None]:
    """Reference (pure Python) of :func:`scan_blocks`: an all-zero block yields None, others their hash."""
    view = _as_view(buf, length)
    n = len(view)
    full = n - n % BLOCK_SIZE
    h = blake3
    zp = _zero_prefix
    out: list[bytes | None] = [
        None if zp(s := view[o : o + BLOCK_SIZE]) else h(s).digest() for o in range(0, full, BLOCK_SIZE)
    ]
    if full != n:
        tail = view[full:]
        out.append(None if zp(tail) else hash_block(tail))
    return out


def hash_blocks(buf: BytesLike, length: int | None = None) -> list[bytes]:
    """Hash every block of ``buf[:length]``; the last block is zero-padded if short.

    Returns one 32-byte hash per block, in order (``ceil(length / BLOCK_SIZE)`` of them).
    """
    flat = native.hash_blocks(_as_view(buf, length))
    return [flat[o : o + HASH_SIZE] for o in range(0, len(flat), HASH_SIZE)]


def scan_blocks(buf: BytesLike, length: int | None = None) -> list[bytes | None]:
    """Like :func:`hash_blocks`, but an all-zero block yields None instead of being hashed."""
    return native.scan_blocks(_as_view(buf, length))
