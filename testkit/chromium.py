"""Debian's chromium, the one browser the browser tests, the benchmarks and the README's pictures drive through
Playwright (``make setup`` installs it); ``CAPSULE_CHROMIUM`` names another build."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CHROMIUM = Path(os.environ.get("CAPSULE_CHROMIUM", "/usr/bin/chromium"))


def launch(playwright: Any) -> Any:
    """Debian's chromium, headless, through a started Playwright (``sync_playwright()``); without its sandbox
    when run as root, which chromium refuses otherwise."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                      args=["--no-sandbox"] if os.geteuid() == 0 else [])
