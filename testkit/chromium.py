"""Debian's chromium, the one browser the browser tests, the benchmarks and the README's pictures drive through
Playwright (``make setup`` installs it); ``CAPSULE_CHROMIUM`` names another build."""

from __future__ import annotations

import os
from pathlib import Path

CHROMIUM = Path(os.environ.get("CAPSULE_CHROMIUM", "/usr/bin/chromium"))
