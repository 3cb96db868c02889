"""Processes a test or a benchmark started in sessions of their own, ended with their whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def stop_groups(procs: list[subprocess.Popen[Any]], wait: float = 5.0) -> None:
    """End each process (started with ``start_new_session``) with its whole group: TERM, then KILL."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    procs.clear()
