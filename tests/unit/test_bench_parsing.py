"""Pure parsing in the live-migration benchmark: libvirt's completed-job statistics and tc's class counters."""

from __future__ import annotations

import pytest

from bench.jobstats import job_figures, parse_rawstats
from bench.looplink import class_bytes

pytestmark = pytest.mark.unit

# `virsh domjobinfo --completed --rawstats` on the destination after a multifd + zstd migration (shape as printed)
RAWSTATS = """Job type:         3

operation: 4
time_elapsed: 152627
time_elapsed_net: 152591
downtime: 3618
setup_time: 2
data_processed: 143399333
memory_processed: 143399333
memory_iteration: 4
disk_processed: 9437184
compression_method: zstd
compression_level: 1
"""

TC_CLASSES = """class htb 1:10 root leaf 10: prio 0 rate 8Mbit ceil 8Mbit burst 64Kb cburst 64Kb
 Sent 4005246 bytes 79 pkt (dropped 21, overlimits 38 requeues 0)
 backlog 66b 1p requeues 0
 lended: 46 borrowed: 0 giants: 0

class htb 1:20 root leaf 20: prio 0 rate 8Mbit ceil 8Mbit burst 64Kb cburst 64Kb
 Sent 3292 bytes 50 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_rawstats_numbers_and_words():
    stats = parse_rawstats(RAWSTATS)
    assert stats["Job type"] == 3
    assert stats["downtime"] == 3618
    assert stats["compression_method"] == "zstd"
    assert "" not in stats


def test_job_figures_pick_the_fields():
    f = job_figures(parse_rawstats(RAWSTATS))
    assert f["elapsed_ms"] == 152627
    assert f["downtime_ms"] == 3618
    assert f["memory_processed_bytes"] == 143399333
    assert f["disk_processed_bytes"] == 9437184
    assert f["memory_iterations"] == 4
    assert f["compression"] == {"compression_method": "zstd", "compression_level": 1}


def test_job_figures_missing_fields_are_none():
    f = job_figures(parse_rawstats("time_elapsed: 10\n"))
    assert f["downtime_ms"] is None
    assert f["compression"] is None


def test_class_bytes_per_class():
    assert class_bytes(TC_CLASSES) == {"1:10": 4005246, "1:20": 3292}
    assert class_bytes("") == {}
