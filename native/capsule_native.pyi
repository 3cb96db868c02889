"""Type stub of the compiled extension (src/lib.rs, src/xzstream.rs): what the type checker knows of it.

Keep it in step with the ``#[pyfunction]``/``#[pyclass]`` signatures; maturin ships it in the wheel.
Buffers (``PyBuffer<u8>``) take anything with the buffer protocol; ``&[u8]`` takes ``bytes`` only;
``Vec<u64>`` any sequence of ints.
"""

from collections.abc import Sequence
from os import PathLike
from typing import Self, final

from typing_extensions import Buffer

BLOCK_SIZE: int

class ShortRead(OSError):
    """The file ended before the requested range."""

class ZstdError(ValueError):
    """A zstd payload could not be decoded."""

class XzError(ValueError):
    """An xz stream segment could not be decoded."""

def hash_blocks(buf: Buffer) -> bytes: ...
def scan_blocks(buf: Buffer) -> list[bytes | None]: ...
def scan_records(buf: Buffer, first: int, zero_flag: bool) -> bytes: ...
def file_records(fd: int, start: int, end: int, zero_flag: bool) -> bytes: ...
def layer_table_records(
    fd: int,
    table: bytes,
    base_cluster: int,
    n_entries: int,
    extended: bool,
    cluster_size: int,
    subcluster_size: int,
    block_count: int,
    virtual_size: int,
    file_size: int,
) -> bytes | None: ...
def blake3_file(path: str | PathLike[str]) -> bytes: ...
def verify_blocks(buf: Buffer, expected: bytes, hash_len: int) -> int: ...
def compress(raw: Buffer, level: int) -> bytes: ...
def compress_many(parts: Sequence[Buffer], level: int) -> list[bytes]: ...
def decompress(payload: Buffer, limit: int) -> bytes: ...
def pwrite_runs(fd: int, indices: Sequence[int], data: Buffer, durable: bool) -> None: ...
def cache_candidates(table: Buffer, bucket_count: int, buckets_offset: int, prefixes: bytes) -> bytes: ...
def cache_put_many(
    table: Buffer,
    bucket_count: int,
    buckets_offset: int,
    keys: bytes,
    offsets: Sequence[int],
    fids: Sequence[int],
    evict_sample: int,
    seed: int,
) -> tuple[int, int, int, int]: ...
def cache_bump_uses(table: Buffer, positions: Sequence[int]) -> None: ...
def read_verified(fd: int, offsets: Sequence[int], prefixes: bytes) -> list[tuple[bytes, bytes] | None]: ...
def hash_at(fd: int, indices: Sequence[int]) -> bytes: ...

@final
class StreamEncoder:
    def __new__(cls, level: int) -> Self: ...
    def segment(self, raw: Buffer) -> bytes: ...

@final
class StreamDecoder:
    def __new__(cls) -> Self: ...
    def segment(self, payload: Buffer, size: int) -> bytes: ...

@final
class XzStreamEncoder:
    def __new__(cls) -> Self: ...
    def segment(self, raw: Buffer) -> bytes: ...

@final
class XzStreamDecoder:
    def __new__(cls) -> Self: ...
    def segment(self, payload: Buffer, size: int) -> bytes: ...
