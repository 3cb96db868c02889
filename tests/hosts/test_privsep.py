"""The compose hosts' agents run as the unprivileged user capsule, beside a root helper; what the tests did
through them and through each host's CLI (run as root, which switches to the store's owner) left the store
the agent's user's alone. Named to run after the other host tests (files sort by name)."""

from __future__ import annotations

import time

import httpx
import pytest
from websockets.sync.client import connect

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

STATUS = ("for p in $(pgrep -f ' serve --user capsule'); do [ \"$p\" = $$ ] && continue; "
          "echo \"$p $(tr '\\0' ' ' < /proc/$p/cmdline)\"; "
          "grep -E '^(Uid|Gid|CapPrm|CapEff|CapBnd|NoNewPrivs):' /proc/$p/status; done")


@pytest.mark.parametrize("which", [0, 1])
def test_the_agent_runs_unprivileged_and_keeps_its_store(seeded, which):
    host = seeded[which]
    out = host.sh(STATUS)
    lines = out.splitlines()
    assert sum(" serve --user capsule " in ln for ln in lines) == 1, out
    fields = dict(ln.split(":", 1) for ln in lines if ":" in ln and not ln[0].isdigit())
    uid = host.sh("id -u capsule").strip()
    assert uid != "0"
    assert fields["Uid"].split() == [uid] * 4, out
    for cap in ("CapPrm", "CapEff", "CapBnd"):
        assert int(fields[cap], 16) == 0, out
    assert fields["NoNewPrivs"].strip() == "1", out
    helper = host.sh("pgrep -u 0 -f 'python.* -m capsule[.]privsep[.]helper'").split()
    assert len(helper) == 1, "exactly one root helper beside the agent"
    # what the agent and each `capsule …` run as root made is the capsule user's (the CLI switched to it)
    strangers = host.sh('find "$CAPSULE_HOME" -maxdepth 1 ! -user capsule; '
                        'find "$CAPSULE_HOME/layers" "$CAPSULE_HOME/files" "$CAPSULE_HOME/tmp" ! -user capsule')
    assert strangers.strip() == "", strangers


def test_the_unprivileged_agent_opens_the_serial_console_through_its_root_helper(fresh):
    """QEMU's user owns a guest's serial pty (mode 0620): the agent, not root, gets its descriptor from the root
    helper, so the dashboard's serial console opens on these hosts and carries keys both ways."""
    a, _b, name = fresh
    a.capsule("start", name)
    try:
        with httpx.Client(base_url=a.url, timeout=30) as web:
            r = web.post("/api/session", json={"token": a.token})
            assert r.status_code == 200, r.text
            r = web.post(f"/api/capsules/{name}/console-ticket", params={"kind": "serial"},
                         headers={"X-CSRF-Token": r.json()["csrf"]})
            assert r.status_code == 200, r.text
            ws_url = a.url.replace("http://", "ws://") + r.json()["url"]
            cookie = "; ".join(f"{k}={v}" for k, v in web.cookies.items())
        with connect(ws_url, additional_headers={"Cookie": cookie}, open_timeout=30) as ws:
            seen, deadline = "", time.monotonic() + 60
            while "serial-" + "ok-42" not in seen:
                assert time.monotonic() < deadline, f"the guest never answered on its serial console: {seen[-400:]}"
                ws.send("echo serial-ok-$((40+2))\n")
                try:
                    while True:
                        msg = ws.recv(timeout=2)
                        seen += msg if isinstance(msg, str) else msg.decode("utf-8", "replace")
                except TimeoutError:
                    pass
    finally:
        a.capsule("stop", name, "--force")
