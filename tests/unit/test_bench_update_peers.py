"""Pure parts of B1 (bench/update_bytes.py): rsync's --stats, casync's new chunks, the issue's goals."""

from __future__ import annotations

import pytest

from bench.update_peers import _ls, block_numbers, goals, new_chunk_bytes, rsync_stats

pytestmark = pytest.mark.unit

# `rsync -z --stats` of one file through a remote shell (shape as printed by rsync 3.2)
RSYNC = """
Number of files: 1 (reg: 1)
Number of created files: 0
Number of regular files transferred: 1
Total file size: 2,147,483,648 bytes
Total transferred file size: 2,147,483,648 bytes
Literal data: 1,234,567 bytes
Matched data: 2,146,249,081 bytes
File list size: 0
Total bytes sent: 987,654
Total bytes received: 3,145,763

sent 987,654 bytes  received 3,145,763 bytes  95,304.69 bytes/sec
"""


def test_rsync_stats_reads_sent_and_literal_bytes_with_commas():
    assert rsync_stats(RSYNC) == {"sent_bytes": 987_654, "literal_bytes": 1_234_567}


def test_rsync_stats_refuses_output_without_the_figure():
    with pytest.raises(ValueError, match="Total bytes sent"):
        rsync_stats("sent 12 bytes  received 3 bytes\n")


def test_new_chunk_bytes_counts_only_chunks_the_seed_lacks():
    seeded = {"aa.cacnk": 100, "bb.cacnk": 200}
    new = {"aa.cacnk": 100, "cc.cacnk": 50, "dd.cacnk": 7}
    assert new_chunk_bytes(seeded, new) == (2, 57)
    assert new_chunk_bytes(seeded, {}) == (0, 0)


def test_goals_ratio_applies_only_to_installs_of_10_mb_and_more():
    peers = ["zstd_bytes", "rsync_bytes"]
    big = {"deb_bytes": 20_000_000, "hcp_wire_bytes": 15_000_000, "zstd_bytes": 18_000_000, "rsync_bytes": 16_000_000}
    assert goals(big, peers) == {"hcp_le_0.8_debs": True, "hcp_smallest": True, "peers_not_larger": []}
    over = {**big, "hcp_wire_bytes": 16_000_001}
    assert goals(over, peers)["hcp_le_0.8_debs"] is False
    assert goals(over, peers)["peers_not_larger"] == ["rsync_bytes"]
    small = {"deb_bytes": 400_000, "hcp_wire_bytes": 900_000, "zstd_bytes": 800_000}
    g = goals(small, peers)                     # rsync not measured: not counted
    assert g["hcp_le_0.8_debs"] is None and g["hcp_smallest"] is False and g["peers_not_larger"] == ["zstd_bytes"]


def test_block_numbers_and_listing_parse_debugfs_output():
    assert block_numbers("1024 1025 1026 \n77\n") == {1024, 1025, 1026, 77}
    ls = "/2/040755/0/0/./4096/\n/2/040755/0/0/../4096/\n/131/100640/0/101/system.journal/8388608/\n"
    assert _ls(ls) == ["system.journal"]
