"""A completed libvirt migration job's figures, from ``virsh domjobinfo --completed --rawstats``."""

from __future__ import annotations

import re
from typing import Any


def parse_rawstats(text: str) -> dict[str, Any]:
    """``virsh domjobinfo --rawstats``: one ``name: value`` a line; numbers as int/float, the rest as str."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        key, value = (p.strip() for p in line.split(":", 1))
        if not key:
            continue
        if re.fullmatch(r"-?\d+", value):
            out[key] = int(value)
        elif re.fullmatch(r"-?\d+\.\d+", value):
            out[key] = float(value)
        else:
            out[key] = value
    return out


def job_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """What the table needs from a completed migration job's raw statistics."""
    def get(*names: str) -> Any:
        return next((stats[n] for n in names if n in stats), None)
    return {"elapsed_ms": get("time_elapsed"), "downtime_ms": get("downtime"),
            "data_processed_bytes": get("data_processed"), "memory_processed_bytes": get("memory_processed"),
            "disk_processed_bytes": get("disk_processed"), "memory_iterations": get("memory_iteration"),
            "compression": {k: v for k, v in stats.items() if k.startswith("compression_")} or None}
