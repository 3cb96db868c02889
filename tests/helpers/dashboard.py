"""Steps the browser tests share on the dashboard's page (Playwright)."""

from __future__ import annotations

from typing import Any


def sign_in(page: Any, url: str, token: str) -> None:
    """Open the dashboard at ``url`` and sign in with ``token``."""
    page.goto(url)
    page.fill("#token", token)
    page.click("#sign-in-form button[type=submit]")


def open_console(page: Any, capsule: str, host: str = "local", timeout_ms: int = 30_000) -> Any:
    """Wait for ``capsule`` to be listed running on ``host``'s card, press its Console button and wait for the
    console to connect; the capsule's row."""
    from playwright.sync_api import expect

    row = page.locator(f'section[data-host="{host}"] tr[data-capsule="{capsule}"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running")
    row.locator('button[data-action="console"]').click()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=timeout_ms)
    return row
