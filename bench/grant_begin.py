"""What a push's ``begin`` costs when a grant pushes: only blocks of objects the grant may read count as held
(``capsule/exchange/holdings.py``), against a host token's begin, which looks every block up (as before).

A store holds two capsules' memory images of ``--mib`` each (``mine`` and ``theirs``), in its hash cache; a
new memory image of ``mine`` made of both images' blocks (twice ``--mib``) is begun part by part (8,192
records a part, as a push sends them) by the receiver without HTTP (``Inbox.begin``), with no receive state
left between runs:

- ``host token``: every block is held (none needed);
- ``grant, first``: a push grant for ``mine@2``; its index (the sorted hash prefixes of ``mine``'s objects) is
  built on this begin; ``theirs``'s blocks are needed;
- ``grant, again``: the same with the index kept;
- ``grant reading both``: a grant whose record names ``theirs`` too (as its kernel): every block is held, as for
  the host token, so the difference is what the index costs;
- ``host token, again``: the first run once more, last: how much the order alone moves a figure (the hash
  cache's read-ahead follows what was looked up before).

    .venv/bin/python bench/grant_begin.py [--mib 256] [--repeat 3]

Prints a table and writes bench/results/grant_begin.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, temp_workdir, write_result  # noqa: E402
from capsule.accounts.model import PUSH, Grant  # noqa: E402
from capsule.exchange import holdings  # noqa: E402
from capsule.exchange.receiving import Inbox  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.store.objectio import object_path  # noqa: E402
from capsule.transfer.records import record_version  # noqa: E402
from hashcache.blocks import BLOCK_SIZE  # noqa: E402
from hashcache.hcp import MAX_PART_RECORDS, PREFIX_SIZE, Expectation  # noqa: E402
from hashcache.manifest import Manifest, manifest_of_file  # noqa: E402


def _file(store: Store, path: Path, role: str) -> str:
    row = store.seal_file(path, role)
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
    store.index_object(object_path(store, "file", row.id), store.file_manifest(row.id))
    return row.id


def _record(name: str, number: int, cap_uuid: str, kernel: str, initrd: str, memory: str, layer: str) -> dict:
    return {"capsule": name, "number": number, "uuid": cap_uuid, "image": None, "parent_capsule": None,
            "parent_version": None, "memory": memory, "chains": [[layer]], "note": "", "created": 1.0,
            "config": {"memory_mib": 256, "vcpus": 1, "kernel": kernel, "initrd": initrd, "cmdline": "",
                       "marker": "m"}}


def _begin(store: Store, m: Manifest, reader: Grant | None) -> tuple[float, int]:
    """Seconds to begin every part of ``m`` and the blocks needed, from no receive state."""
    shutil.rmtree(store.home / "recv", ignore_errors=True)
    inbox = Inbox(store)
    parts = max(1, -(-len(m) // MAX_PART_RECORDS))
    needed = 0
    t = time.perf_counter()
    for p in range(parts):
        part = Expectation.part_of(m, p * MAX_PART_RECORDS, MAX_PART_RECORDS, PREFIX_SIZE).to_bytes()
        needed += len(inbox.begin("file", m.digest, part, part=p, parts=parts, reader=reader) or [])
    seconds = time.perf_counter() - t
    inbox.close()
    return seconds, needed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of each capsule's memory image")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each begin (the median is shown)")
    args = ap.parse_args()
    blocks = args.mib * (1 << 20) // BLOCK_SIZE
    with temp_workdir("grant-begin-") as work:
        store = Store.open(work / "store")
        data = {}
        for name in ("mine", "theirs", "kernel", "initrd"):
            data[name] = os.urandom(blocks * BLOCK_SIZE if name in ("mine", "theirs") else 4 * BLOCK_SIZE)
            (work / name).write_bytes(data[name])
        kernel, initrd = _file(store, work / "kernel", "kernel"), _file(store, work / "initrd", "initrd")
        mine, theirs = _file(store, work / "mine", "memory"), _file(store, work / "theirs", "memory")
        layer = store.seal_layer(_empty_leaf(store), None)
        with store.catalogue.transaction():
            store.catalogue.add_layer(layer)
        mine_uuid = str(uuid.uuid4())
        record_version(store, _record("mine", 1, mine_uuid, kernel, initrd, mine, layer.id))
        record_version(store, _record("theirs", 1, str(uuid.uuid4()), kernel, initrd, theirs, layer.id))
        pushed = work / "pushed"
        pushed.write_bytes(data["mine"] + data["theirs"])
        m = manifest_of_file(pushed)
        grant = Grant(PUSH, "mine", 2, "bench", record=_record("mine", 2, mine_uuid, kernel, initrd, m.digest,
                                                               layer.id))
        # a grant that may read both images (its record names ``theirs`` as its kernel): every block held
        both = Grant(PUSH, "mine", 2, "bench", record=_record("mine", 2, mine_uuid, theirs, initrd, m.digest,
                                                              layer.id))
        _begin(store, m, None)                          # warm the page cache and the hash cache's file table
        rows = []
        for label, reader in (("host token", None), ("grant reading both, first", both),
                              ("grant reading both, again", both), ("grant, first", grant), ("grant, again", grant),
                              ("host token, again", None)):
            runs = []
            for _ in range(args.repeat):
                if label.endswith("first"):
                    holdings._index = holdings._Index()     # noqa: SLF001  (the index is built on this begin)
                runs.append(_begin(store, m, reader))
            seconds, needed = statistics.median(r[0] for r in runs), runs[0][1]
            rows.append([label, len(m), needed, round(seconds, 3), round(len(m) / seconds / 1000, 1)])
        store.close()
    table(f"begin of a {2 * args.mib} MiB memory image ({len(m)} blocks)",
          ["caller", "blocks", "needed", "seconds", "kblocks/s"], rows)
    columns = ["caller", "blocks", "needed", "seconds", "kblocks_per_s"]
    write_result("grant_begin", {"mib": args.mib, "repeat": args.repeat,
                                 "runs": [dict(zip(columns, r, strict=True)) for r in rows]})


def _empty_leaf(store: Store) -> Path:
    from hashcache.qcow2_writer import write_layer

    leaf = store.new_leaf_path()
    write_layer(leaf, virtual_size=16 * BLOCK_SIZE, backing=None, records=[], read_block=lambda i: b"")
    return leaf


if __name__ == "__main__":
    main()
