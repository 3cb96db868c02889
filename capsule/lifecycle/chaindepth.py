"""Keep a running guest's backing chains shallow enough for libvirt.

Every snapshot adds a layer under the guest's next leaf, so a capsule backed up every minute has a chain of 30
layers after half an hour. libvirt (11.3 here) parses QEMU's block information with a JSON nesting limit, and
each backing layer nests one level deeper: a chain of 27 layers fails to boot or restore ("failed to parse
JSON: nesting too deep"; 24 still works). So before an instance starts on a chain of more than
:data:`MAX_DEPTH` layers, its newest layers are folded into one new layer (a copy of the top one, rebased
safely onto the layer below the fold: the guest reads the same bytes). Only the instance runs on the shallow
chain; the version it started from keeps its own, and the next version sealed from the instance builds on
the shallow one.

Which layers are folded (:func:`fold_from`): the :data:`RECENT` newest, then each layer below them that holds
no more blocks than those already taken. Folded layers so grow geometrically, an old large one is copied again
only when the new ones outgrow it, and the work per snapshot stays small (as in a log-structured merge). If
that leaves the chain too long, older layers are taken too, whatever their size."""

from __future__ import annotations

from collections.abc import Callable

from capsule.hierarchy import rebased_copy
from capsule.lifecycle import demand
from capsule.store import Store
from capsule.store.catalogue import LayerRow

MAX_DEPTH = 20      # layers under a running leaf (libvirt refuses 27; 24 works)
RECENT = 10         # a fold takes at least this many of the newest layers

Say = Callable[[str], None]


def fold_from(blocks: list[int], max_depth: int = MAX_DEPTH, recent: int = RECENT) -> int | None:
    """Where the folded run of a chain starts (its layers' block counts, oldest first), or None if the chain
    is short enough. The fold keeps at least the root layer below it."""
    n = len(blocks)
    if n <= max_depth:
        return None
    k = max(1, n - recent)
    taken = sum(blocks[k:])
    while k > 1 and (blocks[k - 1] <= taken or k + 1 > max_depth - recent + 1):
        k -= 1
        taken += blocks[k]
    return k


def shallow(store: Store, chains: list[list[str]], say: Say) -> list[list[str]]:
    """``chains`` with each one deeper than :data:`MAX_DEPTH` folded (new layers are recorded in the
    catalogue); a chain with a layer paged from elsewhere is left as it is. Call under the store lock."""
    out = []
    for disk, chain in enumerate(chains):
        rows = [store.catalogue.layer(lid) for lid in chain]
        k = fold_from([r.blocks if r else 0 for r in rows])
        if k is None or demand.chain_needs_server(store, chain):
            out.append(list(chain))
            continue
        say(f"disk {disk}: folding the newest {len(chain) - k} of its {len(chain)} layers into one (a chain "
            f"deeper than {MAX_DEPTH} does not start)")
        out.append([*chain[:k], fold(store, chain[k - 1], chain[-1]).id])
    return out


def fold(store: Store, base: str, top: str) -> LayerRow:
    """A new layer over ``base`` that reads as ``top`` does (with every layer between), recorded."""
    row = rebased_copy(store, top, base)
    with store.catalogue.transaction():
        if store.catalogue.layer(row.id) is None:
            store.catalogue.add_layer(row)
    return row
