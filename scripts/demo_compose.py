"""`make demo-compose`: the demo of `make demo`, between two hosts that share nothing but the network.

The hosts are the containers of docker-compose.yml (`make compose-up`: host A on 127.0.0.1:7171, host B
on 127.0.0.1:7172), each with its own root file system, store, libvirtd and agent. The tiny image is
built in a store on this machine and its capsule pushed to host A over the network; from then on what
happens on a host is that host's own CLI (`docker exec … capsule`), and everything between hosts goes
agent to agent with tokens. The capsule boots on A, a counter starts in the guest and it writes to its
disk; it is suspended, pushed to B and started there (the counter goes on: no reboot), moved back to A
(only what changed travels), then migrated to B ballooned and demand-paged. Then each host learns the
other as a peer, the capsule moves home to A by the peer's name, and the demo prints what each step cost
and how to open A's dashboard, where the capsule can be moved by clicking."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console, JustifyMethod  # noqa: E402
from rich.table import Table  # noqa: E402

from capsule import capsules, hierarchy, images, lifecycle, transfer  # noqa: E402
from capsule.errors import Error  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.units import human  # noqa: E402
from scripts.composehosts import DEMO, ComposeError, Host, docker_ready  # noqa: E402

NAME = "demo"
# counts in /tmp/count; every second a line on the screen too (the dashboard's console shows it going on)
COUNTER = ("(i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; "
           "[ $((i % 5)) = 0 ] && echo \"capsule demo: counter $i\" > /dev/tty0; sleep 0.2; done) >/dev/null 2>&1 &")
DSL_BPS = 370_000 / 8     # 384 kbit/s DSL, as TCP goodput (testkit/netlink.py measured 370 kbit/s)
out = Console(highlight=False)


def step(msg: str) -> None:
    out.print(f"[bold blue]==>[/] {msg}")


def write(host: Host, name: str, seek: int, count: int) -> None:
    """The guest writes ``count`` random 4 KiB blocks to its disk at block ``seek``."""
    host.guest(name, f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={seek} count={count} conv=notrunc "
                     "2>/dev/null; sync")


def counter(host: Host, name: str) -> int:
    return int(host.guest(name, "cat /tmp/count"))


def clear(host: Host, name: str) -> None:
    """No capsule ``name`` on ``host`` (a run before this one may have left it there)."""
    line = host.states().get(name)
    if line is None:
        return
    if line["domain"]:  # an instance: running, or crashed (its container was stopped under it)
        host.capsule("stop", name, "--force")
    host.capsule("rm", name, "--promote")


def clear_local(store: Store, name: str) -> None:
    if store.catalogue.capsule(name) is not None:
        if store.catalogue.instance(name) is not None:
            lifecycle.stop(store, name, force=True)
        hierarchy.rm(store, name, promote_dependants=True)


def add_peer(host: Host, peer: Host) -> dict[str, Any]:
    """``host`` knows ``peer`` by its service name (replacing what it knew of that name or that address: a
    peer's token changes with its store); run on ``host`` with its own CLI."""
    for known in host.capsule("host", "ls", "--offline"):
        if known["name"] == peer.service or known["url"] == peer.url:    # also the same host by another name
            host.capsule("host", "rm", known["name"])
    return host.capsule("host", "add", peer.service, peer.url, token=peer.token)


@dataclass
class Story:
    """What each step of the demo did, as the hosts' CLIs reported it (their --json)."""

    boot: dict[str, Any] = field(default_factory=dict)
    to_a: transfer.TransferReport | None = None        # this machine → A (the library's push)
    suspend_a: dict[str, Any] = field(default_factory=dict)
    push_ab: dict[str, Any] = field(default_factory=dict)
    start_b: dict[str, Any] = field(default_factory=dict)
    push_ba: dict[str, Any] = field(default_factory=dict)
    start_a: dict[str, Any] = field(default_factory=dict)
    demand_ab: dict[str, Any] = field(default_factory=dict)
    home_ba: dict[str, Any] = field(default_factory=dict)
    counters: list[int] = field(default_factory=list)  # A, B, A, B, A

    @property
    def counter_went_on(self) -> bool:
        c = self.counters
        return len(c) == 5 and c == sorted(c) and c[-1] > c[0]      # never back, and it did go on


def run(local: Store, a: Host, b: Host, name: str = NAME, say: Callable[[str], None] = step) -> Story:
    """The demo's moves. ``local`` holds the tiny image; ``a`` and ``b`` are up. Ends with ``name`` running on A
    and each host knowing the other as a peer (named by its compose service)."""
    s = Story()
    for host in (a, b):
        clear(host, name)
    clear_local(local, name)
    capsules.create(local, name, "tiny", memory="256M")
    s.to_a = transfer.push(local, name, a.url, a.token)
    say(f"this machine → A: pushed {s.to_a.version} over the network: {human(s.to_a.totals()['raw_bytes'])} of "
        f"data, {human(s.to_a.wire_bytes)} on the wire, {s.to_a.seconds:.2f}s")

    s.boot = a.capsule("start", name)
    say(f"A: booted {s.boot['version']} under {s.boot['accel'].upper()} in {s.boot['seconds']:.2f}s")
    a.guest(name, COUNTER)
    write(a, name, seek=1000, count=256)
    time.sleep(2)
    s.counters.append(counter(a, name))
    say(f"A: the guest's counter is at {s.counters[-1]}; it wrote 1 MiB to its disk")

    s.suspend_a = a.capsule("suspend", name)
    say(f"A: suspended → {s.suspend_a['version']} (save {s.suspend_a['save_seconds']:.2f}s, "
        f"seal {s.suspend_a['seal_seconds']:.2f}s)")
    s.push_ab = a.capsule("push", name, "--to", b.url, token=b.token)
    say(f"A → B: pushed {s.push_ab['version']}: {human(s.push_ab['raw_bytes'])} of data, "
        f"{human(s.push_ab['wire_bytes'])} on the wire, {s.push_ab['seconds']:.2f}s")
    s.start_b = b.capsule("start", name)
    s.counters.append(counter(b, name))
    say(f"B: {s.start_b['mode']}d in {s.start_b['seconds']:.2f}s; the counter went on at {s.counters[-1]} "
        f"(no reboot)")
    write(b, name, seek=3000, count=64)
    time.sleep(1)

    b.capsule("suspend", name)
    s.push_ba = b.capsule("push", name, "--to", a.url, token=a.token)
    say(f"B → A: pushed {s.push_ba['version']}: only the changes travel — {human(s.push_ba['wire_bytes'])} on "
        f"the wire, {len(s.push_ba['skipped'])} object(s) already at A")
    s.start_a = a.capsule("start", name)
    s.counters.append(counter(a, name))
    say(f"A: {s.start_a['mode']}d {s.start_a['version']}; the counter is at {s.counters[-1]}")

    # once more to B, demand-paged: B starts it at once, disk blocks follow from A as the guest reads them
    write(a, name, seek=5000, count=64)
    s.demand_ab = a.capsule("migrate", name, "--to", b.url, "--mode", "demand", "--balloon",
                            "--source-url", a.url, token=b.token)
    s.counters.append(counter(b, name))
    say(f"A → B demand-paged (ballooned): B runs it after {s.demand_ab['seconds']:.2f}s, "
        f"{human(wire(s.demand_ab))} on the wire; the counter is at {s.counters[-1]}")

    # the hosts learn each other (the dashboard shows a peer's capsules and migrates to a peer)
    add_peer(a, b)
    add_peer(b, a)
    # (offline: its disks are still paged in from A, and a live move needs them all here; `--check` says so)
    s.home_ba = b.capsule("migrate", name, "--to", a.service, "--offline")
    s.counters.append(counter(a, name))
    say(f"B → A by the peer's name ({a.service}), full: {s.home_ba['seconds']:.2f}s, "
        f"{human(wire(s.home_ba))} on the wire; the counter is at {s.counters[-1]}")
    return s


def wire(migrated: dict[str, Any]) -> int:
    """Bytes a `capsule migrate --json` put on the wire: its last progress snapshot counts the HCP pushes, and a
    live move's tunnel carried libvirt's memory and disk streams besides."""
    hcp = int((migrated.get("progress") or {}).get("wire_bytes") or 0)
    return hcp + int((migrated.get("live") or {}).get("tunnel_bytes") or 0)


def table(s: Story) -> Table:
    t = Table(title="what it cost (times as each host's CLI reported them)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("step", "left"), ("data", "right"), ("found locally", "right"), ("on the wire", "right"), ("time", "right"),
        ("at 384 kbit/s (DSL)", "right"))
    for col, justify in columns:
        t.add_column(col, justify=justify)
    assert s.to_a is not None
    to_a = s.to_a.totals()
    t.add_row("push this machine → A", human(to_a["raw_bytes"]), human(to_a["cache_bytes"]), human(s.to_a.wire_bytes),
              f"{s.to_a.seconds:.2f} s", f"~{s.to_a.wire_bytes / DSL_BPS:.0f} s")
    t.add_row("boot on A", "", "", "", f"{s.boot['seconds']:.2f} s", "")
    mem = s.suspend_a["memory"] or {}
    t.add_row("suspend on A (256 MiB guest)", f"memory image {human(mem.get('allocated', 0))} allocated", "", "",
              f"{s.suspend_a['save_seconds'] + s.suspend_a['seal_seconds']:.2f} s", "")
    for label, p in (("push A → B (B had nothing)", s.push_ab), ("push B → A (A had the old version)", s.push_ba)):
        t.add_row(label, human(p["raw_bytes"]), human(p["cache_bytes"]), human(p["wire_bytes"]),
                  f"{p['seconds']:.2f} s", f"~{p['wire_bytes'] / DSL_BPS:.0f} s")
    t.add_row(f"{s.start_b['mode']} on B", "", "", "", f"{s.start_b['seconds']:.2f} s", "")
    t.add_row(f"{s.start_a['mode']} on A", "", "", "", f"{s.start_a['seconds']:.2f} s", "")
    for label, m in (("migrate A → B, demand-paged", s.demand_ab), ("migrate B → A (peer name), full", s.home_ba)):
        t.add_row(label, "", "", human(wire(m)), f"{m['seconds']:.2f} s", f"~{wire(m) / DSL_BPS:.0f} s")
    t.add_row("counter: A → B → A → B → A", " → ".join(map(str, s.counters)), "", "", "", "")
    return t


def dashboard(a: Host, b: Host) -> None:
    """How a new user takes it from here: A's page, its token, and how to stop the hosts."""
    cmd = f"docker-compose -p {DEMO.name} exec -T {a.service} sh -c 'cat \"$CAPSULE_HOME/agent.token\"'"
    out.print(f"\n[bold]{NAME}[/] runs on host A. Its dashboard: [bold]{a.url}/[/]")
    out.print(f"  sign in with host A's token, {a.home}/agent.token inside its container; this prints it:\n"
              f"    {cmd}")
    out.print(f"  then Migrate… → {b.service} moves it by clicking (host B's own page: {b.url}/, "
              f"its token the same way with {b.service})")
    down = "make compose-down" if DEMO.name == "capsule" else f"docker-compose -p {DEMO.name} down"
    out.print(f"  `{down}` stops the hosts (their stores stay for the next `make compose-up`)")


def main() -> int:
    t0 = time.monotonic()
    if why := docker_ready():
        out.print(f"[red]demo failed:[/] {why}")
        return 1
    step("bringing up the compose hosts (`make compose-up`; the first run builds the images)")
    t = time.monotonic()
    DEMO.up(show=True)
    up_seconds = time.monotonic() - t
    a, b = DEMO.host("host-a"), DEMO.host("host-b")
    step(f"hosts up in {up_seconds:.1f}s: A at {a.url} (store {a.home}), B at {b.url} (store {b.home})")

    local = Store.open()
    t = time.monotonic()
    with out.status("building the tiny image on this machine (the first run downloads a kernel)"):
        _row, built = images.build(local, "tiny", "tiny")
    step(f"image tiny {'built' if built else 'already built'} in {time.monotonic() - t:.1f}s (store {local.home})")
    story = run(local, a, b)
    out.print(table(story))
    step(f"the whole demo took {time.monotonic() - t0:.0f}s (compose-up {up_seconds:.0f}s)")
    dashboard(a, b)
    out.print("[green]demo OK[/]" if story.counter_went_on else "[red]the counter did not continue[/]")
    return 0 if story.counter_went_on else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Error, ComposeError) as exc:
        out.print(f"[red]demo failed:[/] {exc}")
        sys.exit(1)
