"""A real QEMU migration stream through the memory codec (capsule/migrate/ramstream.py, ramdedup.py, memrefs.py):
a running tiny guest migrates to this process, its stream goes encoder → decoder → a file, and the guest restored
from that file has its memory intact; pages also on its disk (its page cache, a tmpfs copy of disk blocks) and
in its kernel file (QEMU's copy of it stays in the guest's memory) travel as references, and so do pages of the
kernel as it unpacked itself (memory-kernel), those its relocations changed as deltas (memdelta.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.migrate import memrefs
from capsule.migrate.ramdedup import Decoder, Encoder, Known
from capsule.migrate.ramstream import RamStream
from capsule.runtime.connection import lookup_domain
from testkit import qemustream
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

# 16 MiB of random data in tmpfs, 8 MiB of random data written to the disk (its blocks stay in the page cache),
# and a tmpfs copy of 4 MiB of them
DISK = "dd if=/dev/urandom of=/dev/vda bs=4096 count=2048 conv=notrunc 2>/dev/null; sync"
WORKLOAD = ("head -c 16777216 /dev/urandom > /dev/shm/random; head -c 4194304 /dev/vda > /dev/shm/copy; "
            "md5sum /dev/shm/random /dev/shm/copy")


def test_a_guest_restored_from_the_decoded_stream_has_its_memory_and_disk_pages_went_as_refs(store, tmp_path):
    capsules.create(store, "m", "tiny", memory="256M")
    lifecycle.start(store, "m")
    run(store, "m", DISK, timeout=180)
    version = lifecycle.snapshot(store, "m")[0].version       # T0: the disk's blocks in a version's layers
    before = run(store, "m", WORKLOAD, timeout=180)
    copy_size = 4 << 20
    inst = store.catalogue.instance("m")
    objects = memrefs.shared_objects(store, version)          # the layers of T0's disk, the image's below them
    known = memrefs.known_of(store, objects)
    assert {("file", version.config["kernel"]), ("file", version.config["initrd"])} <= set(objects)
    layers = Encoder(memrefs.known_of(store, [o for o in objects if o[0] == "layer"]))   # without the boot files
    with_kernel = memrefs.shared_objects(store, version, kernel=True)
    assert with_kernel == objects + [("kernel", version.config["kernel"])]
    resolver = memrefs.StoreResolver(store, with_kernel)
    unpacked = memrefs.known_of(store, with_kernel)
    encoder, plain, decoder = Encoder(unpacked, runs=True, delta=True), Encoder(Known()), Decoder(resolver)
    held = Encoder(known, runs=True)                           # what a peer without memory-kernel gets
    hashes, by_hash = Encoder(known), Decoder(memrefs.StoreResolver(store, objects))   # held pages as hashes
    parser = RamStream()
    out = tmp_path / "stream.bin"
    raw, digest, again = [0], hashlib.sha256(), hashlib.sha256()   # the stream's bytes, their digest twice
    with out.open("wb") as f:
        def sink(chunk: bytes) -> None:
            raw[0] += len(chunk)
            digest.update(chunk)
            parser.feed(chunk)
            plain.encode(chunk)
            layers.encode(chunk)
            held.encode(chunk)
            again.update(by_hash.decode(hashes.encode(chunk)))
            f.write(decoder.decode(encoder.encode(chunk)))

        dom = lookup_domain(store.domain_name("m"))
        xml = qemustream.save_xml(dom)
        qemustream.stream_out(dom, Path(inst.dir), sink)
        f.write(decoder.decode(encoder.finish()))
        plain.finish()
        layers.finish()
        held.finish()
        again.update(by_hash.decode(hashes.finish()))
        decoder.finish()
        by_hash.finish()
    resolver.close()
    assert again.digest() == digest.digest()                   # the stream rebuilt from hashes, byte for byte
    assert out.stat().st_size == raw[0]
    assert hashlib.sha256(out.read_bytes()).digest() == digest.digest()   # QEMU's stream, byte for byte
    assert parser.counts.reason == "device state"               # pages were parsed up to the device state

    d = encoder.stats
    print(f"\nstream {raw[0]} bytes, {parser.counts.pages} pages; zstd {plain.stats.wire_bytes}; "
          f"dedup+zstd {d.wire_bytes} (refs {d.refs} in {d.runs} runs, recent {d.recent}, raw pages {d.raw_pages}); "
          f"held pages as hashes instead {hashes.stats.wire_bytes}; "
          f"known {len(known)} hashes, {known.nbytes} bytes; refs to layers alone {layers.stats.refs}")
    h = held.stats
    print(f"without the unpacked kernel {h.wire_bytes} (refs {h.refs}); with it {d.wire_bytes} (refs {d.refs}, "
          f"deltas {d.deltas})")
    assert h.refs >= copy_size // 4096                          # at least the tmpfs copy of disk blocks
    assert h.refs - layers.stats.refs >= 1000                   # the kernel file's pages (~3,500 of them)
    assert h.wire_bytes < plain.stats.wire_bytes - (copy_size // 2)
    assert hashes.stats.refs == h.refs and h.runs < h.refs // 4   # the same pages held, most in runs
    assert h.wire_bytes < hashes.stats.wire_bytes - h.refs * 30     # each costing far less than 33 + 5 bytes
    # the unpacked kernel: ~4,200 more pages held and ~2,900 as deltas in B2-live's tiny guest, 9.7 MB less
    assert d.refs - h.refs >= 1000 and d.deltas >= 500 and d.wire_bytes < h.wire_bytes - (3 << 20)

    qemustream.restore_stream(dom, xml, out, tmp_path)
    assert run(store, "m", "md5sum /dev/shm/random /dev/shm/copy") == before   # its memory, intact
