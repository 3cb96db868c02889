"""The flattened view of a layer chain, served block by block (demand paging, §4.3 of the Collective paper).

A :class:`ChainSpec` names the layers of one disk, bottom (root) to top, each either *local* (a qcow2
file on this host) or *remote* (on a source host, reached by HCP), with every layer's manifest as a
local file. A :class:`Chain` resolves, once at open, every 4 KiB guest block to the topmost layer
that owns it and serves reads of the flattened disk:

* a block no layer owns, or that its owner flags as zero: zeros, no I/O;
* a block of a local layer: read from its qcow2 file;
* a block of a remote layer: from the layer's *shadow* (``<shadow_dir>/<layer-id>.data`` and
  ``.bitmap``: a sparse file plus a persistent presence bitmap, shared by every chain using the
  layer — layers are immutable — and surviving restarts); else from the host's hash cache (the
  cache verifies the data); else fetched from the source host with HCP READ, in one batch with the
  request's other missing blocks and a read-ahead window that grows while reads are sequential.
  Every fetched block is checked against its manifest hash; a wrong block is an error naming the
  layer and block, and is neither served nor stored.

Fetched blocks are served at once from memory and made durable behind the reader's back
(*write-behind*): a persister thread writes them to the shadow, fdatasyncs once per group and only
then sets their presence bits (``Shadow.store``), then records them in the hash cache. Until then
they are served from memory. An fdatasync costs ~0.3 ms here — more than the rest of a miss on
loopback — so it stays off the read path; a crash loses at most the blocks not yet persisted (they
are fetched again), never marks a block present that is not on disk. ``write_behind=False`` stores
synchronously instead.

Thread-safe: reads may come from many threads at once (nbdkit's parallel thread model). Reads of
present blocks take no lock; misses claim their blocks, so two threads never fetch a block twice
(except that a foreground read never waits for a background prefetch batch: it fetches the block
itself).
"""

from __future__ import annotations

from diskserver.chain.facade import Chain
from diskserver.chain.layers import Progress
from diskserver.chain.spec import SPEC_VERSION, ChainSpec, LayerSpec, ReadaheadSpec, RemoteSpec, RetrySpec

__all__ = ["SPEC_VERSION", "Chain", "ChainSpec", "LayerSpec", "Progress", "ReadaheadSpec", "RemoteSpec", "RetrySpec"]
