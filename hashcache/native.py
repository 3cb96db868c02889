"""The compiled hot paths (the ``capsule_native`` extension, built from ``native/`` by ``make setup``).

The extension is required: per-block work (BLAKE3 of every 4 KiB block into manifest records, zstd
batches, checking received blocks, writing runs of blocks into a shadow, hashing a complete shadow,
the hash cache's bucket search and verified reads for a receiver's plan, and its inserts) runs there with the GIL
released and spread over the cores. The pure-Python code it replaced stays in the modules that
define the formats (``blocks.py``: ``py_hash_blocks``/``py_scan_blocks``; ``manifest.py``:
``_RecordBuilder.add_hashes``; ``hcp.py``: ``_reference_*``; ``shadow.py``: ``_reference_write``;
``cache/lookup.py``: ``lookup_prefix``, which ``lookup_prefix_many`` falls back to; ``cache/table.py``:
``_put``, the reference of ``_put_many``) as
the reference the extension must agree with byte for byte: the property tests in
``tests/unit/test_native_*.py`` hold the two to the same answers, and to the same refusals.
"""

from __future__ import annotations

from hashcache.errors import HashcacheError

try:
    import capsule_native as _ext
except ImportError as _exc:  # pragma: no cover - only without `make setup`
    raise HashcacheError(
        "the compiled extension capsule_native is not installed; run `make setup` (it builds native/ "
        f"with cargo) ({_exc})"
    ) from _exc

hash_blocks = _ext.hash_blocks
scan_blocks = _ext.scan_blocks
scan_records = _ext.scan_records
file_records = _ext.file_records
blake3_file = _ext.blake3_file
verify_blocks = _ext.verify_blocks
compress = _ext.compress
compress_many = _ext.compress_many
decompress = _ext.decompress
pwrite_runs = _ext.pwrite_runs
cache_candidates = _ext.cache_candidates
cache_put_many = _ext.cache_put_many
cache_bump_uses = _ext.cache_bump_uses
read_verified = _ext.read_verified
hash_at = _ext.hash_at
StreamEncoder = _ext.StreamEncoder
StreamDecoder = _ext.StreamDecoder
XzStreamEncoder = _ext.XzStreamEncoder
XzStreamDecoder = _ext.XzStreamDecoder
layer_table_records = _ext.layer_table_records
ShortRead = _ext.ShortRead
ZstdError = _ext.ZstdError
XzError = _ext.XzError

__all__ = [
    "ShortRead", "StreamDecoder", "StreamEncoder", "XzError", "XzStreamDecoder", "XzStreamEncoder", "ZstdError",
    "blake3_file", "cache_bump_uses",
    "cache_candidates", "cache_put_many",
    "compress", "compress_many", "decompress", "file_records", "hash_at", "hash_blocks", "layer_table_records",
    "pwrite_runs", "read_verified", "scan_blocks", "scan_records", "verify_blocks",
]
