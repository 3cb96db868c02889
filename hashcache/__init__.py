"""Block hashing, manifests and a read-only qcow2 reader.

Knows nothing of capsules or libvirt: it hashes files and qcow2 layers into manifests whose
digests name them, and checks data against those manifests.
"""

from hashcache.blocks import ALGORITHM, BLOCK_SIZE, HASH_SIZE, hash_block, hash_blocks, is_zero, scan_blocks
from hashcache.cache import CacheEntry, CacheError, HashCache, PrimeResult, remove_cache
from hashcache.errors import (
    CorruptImageError,
    HashcacheError,
    ManifestError,
    ManifestMismatch,
    UnsupportedImageError,
)
from hashcache.manifest import (
    Manifest,
    manifest_of_file,
    manifest_of_layer,
    verify_file,
    verify_layer,
)
from hashcache.qcow2 import BlockKind, BlockRun, Qcow2Image

__all__ = [
    "ALGORITHM",
    "BLOCK_SIZE",
    "HASH_SIZE",
    "BlockKind",
    "BlockRun",
    "CacheEntry",
    "CacheError",
    "CorruptImageError",
    "HashCache",
    "HashcacheError",
    "Manifest",
    "ManifestError",
    "ManifestMismatch",
    "PrimeResult",
    "Qcow2Image",
    "UnsupportedImageError",
    "hash_block",
    "hash_blocks",
    "is_zero",
    "manifest_of_file",
    "manifest_of_layer",
    "remove_cache",
    "scan_blocks",
    "verify_file",
    "verify_layer",
]
