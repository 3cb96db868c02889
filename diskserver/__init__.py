"""The demand-paging disk server (§4.3 of the Collective paper).

Knows layers, manifests, shadows, the hash cache and the HCP client; nothing of capsules. A
:class:`~diskserver.chain.ChainSpec` describes one disk's chain of layers (local or remote, bottom to
top); :class:`~diskserver.chain.Chain` serves reads of the flattened disk, fetching remote blocks on
demand into shared shadows; :class:`~diskserver.server.DiskServer` runs it under nbdkit as a
read-only NBD export on a unix socket (plugin: ``diskserver/plugin.py``).
"""

from diskserver.chain import Chain, ChainSpec, LayerSpec, ReadaheadSpec, RemoteSpec, RetrySpec
from diskserver.errors import BlockMismatch, DiskServerError, ServerError, SourceError, SourceUnavailable, SpecError
from diskserver.server import DiskServer

__all__ = [
    "BlockMismatch",
    "Chain",
    "ChainSpec",
    "DiskServer",
    "DiskServerError",
    "LayerSpec",
    "ReadaheadSpec",
    "RemoteSpec",
    "RetrySpec",
    "ServerError",
    "SourceError",
    "SourceUnavailable",
    "SpecError",
]
