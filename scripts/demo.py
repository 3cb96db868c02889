"""`make demo`: the main job end to end, on two local hosts.

Host A is the default store; host B is a second store beside it with its own
agent on a loopback port. The demo builds the tiny guest image, boots a
capsule on A, starts a counter inside it and writes to its disk, suspends it,
pushes it to B with HCP, resumes it on B (the counter goes on: no reboot),
then moves it back to A, where only what changed travels, and finally moves it
to B again demand-paged (ballooned first): B runs it at once and fetches disk
blocks as the guest reads them. It prints what each step cost."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from rich.console import Console
from rich.table import Table

from capsule import capsules, hierarchy, hosts, images, lifecycle, transfer
from capsule.agent.launch import AgentProcess
from capsule.console.serial import ConsoleSession
from capsule.errors import Error
from capsule.migrate import migrate
from capsule.store import Store
from capsule.units import human

NAME = "demo"
DESK = "desk"       # the desktop capsule the dashboard step starts (CAPSULE_DEMO_DESKTOP=0: none)
# the counter also shows on the guest's screen (the dashboard's console) every second
COUNTER = ("(i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; "
           "[ $((i % 5)) = 0 ] && echo \"capsule demo: counter $i\" > /dev/tty0; sleep 0.2; done) >/dev/null 2>&1 &")
out = Console(highlight=False)


def step(msg: str) -> None:
    out.print(f"[bold blue]==>[/] {msg}")


def guest(store: Store, command: str) -> str:
    with ConsoleSession(store.domain_name(NAME)) as c:
        return c.run(command)


def fresh(store: Store) -> None:
    for name in (NAME, DESK):          # an earlier run's capsules, wherever they ended
        if store.catalogue.capsule(name) is not None:
            if store.catalogue.instance(name) is not None:
                lifecycle.stop(store, name, force=True)
            hierarchy.rm(store, name, promote_dependants=True)


def main() -> int:
    a = Store.open()
    b_home = a.home.parent / (a.home.name + "-host-b")
    b = Store.open(b_home)
    step(f"host A: store {a.home} (id {a.id}); host B: store {b.home} (id {b.id})")
    t = time.monotonic()
    with out.status("building the tiny image (the first run downloads a kernel)"):
        _row, built = images.build(a, "tiny", "tiny")
    step(f"image tiny {'built' if built else 'already built'} in {time.monotonic() - t:.1f}s")
    for s in (a, b):
        fresh(s)
    agents: list[AgentProcess] = []
    try:
        # both agents speak TLS with their own host keys; each side pins the other's certificate fingerprint
        agents.append(AgentProcess(b.home, b.home / "agent.token", log_path=b.home / "agent.log", tls=True))
        url_b, token_b, pin_b = agents[-1].url, agents[-1].token, agents[-1].fingerprint
        agents.append(AgentProcess(a.home, a.home / "agent.token", log_path=a.home / "agent.log", tls=True))
        url_a, token_a, pin_a = agents[-1].url, agents[-1].token, agents[-1].fingerprint
        step(f"agents over TLS: A {url_a} ({pin_a}), B {url_b} ({pin_b})")

        capsules.create(a, NAME, "tiny", memory="256M")
        boot = lifecycle.start(a, NAME)
        step(f"A: booted {boot.version.ref} under {boot.accel.upper()} in {boot.seconds:.2f}s")
        guest(a, COUNTER)
        guest(a, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=1000 count=256 conv=notrunc 2>/dev/null; sync")
        time.sleep(2)
        before = int(guest(a, "cat /tmp/count"))
        step(f"A: the guest's counter is at {before}; it wrote 1 MiB to its disk")

        s1 = lifecycle.suspend(a, NAME)
        assert s1.version is not None and s1.memory is not None   # a suspend records both
        step(f"A: suspended → {s1.version.ref} (save {s1.save_seconds:.2f}s, seal {s1.seal_seconds:.2f}s)")
        p1 = transfer.push(a, s1.version.ref, url_b, token_b, fingerprint=pin_b)
        step(f"A → B: pushed {p1.version}: {human(p1.totals()['raw_bytes'])} of data, "
             f"{human(p1.wire_bytes)} on the wire, {p1.seconds:.2f}s")
        r1 = lifecycle.start(b, NAME)
        at_b = int(guest(b, "cat /tmp/count"))
        step(f"B: resumed in {r1.seconds:.2f}s; the counter went on at {at_b} (no reboot)")
        guest(b, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=3000 count=64 conv=notrunc 2>/dev/null; sync")
        time.sleep(1)

        s2 = lifecycle.suspend(b, NAME)
        assert s2.version is not None
        p2 = transfer.push(b, s2.version.ref, url_a, token_a, fingerprint=pin_a)
        step(f"B → A: pushed {p2.version}: only the changes travel — {human(p2.wire_bytes)} on the wire, "
             f"{len(p2.skipped)} object(s) already at A")
        r2 = lifecycle.start(a, NAME)
        back = int(guest(a, "cat /tmp/count"))
        step(f"A: resumed {r2.version.ref}; the counter is at {back}")

        # and once more to B, this time demand-paged: B starts at once, disk blocks follow as they are read
        guest(a, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=5000 count=64 conv=notrunc 2>/dev/null; sync")
        m3 = migrate(a, NAME, url_b, token_b, mode="demand", balloon="cache", source_url=url_a, source_token=token_a,
                     fingerprint=pin_b, source_fingerprint=pin_a)
        at_b2 = int(guest(b, "cat /tmp/count"))
        step(f"A → B demand-paged (ballooned): B runs it after {m3.seconds:.2f}s, "
             f"{human(m3.remote.get('moved_bytes', 0))} moved first; the counter is at {at_b2}")

        cost = Table(title="what it cost")
        cost.add_column("step")
        cost.add_column("data", justify="right")
        cost.add_column("found locally", justify="right")
        cost.add_column("on the wire", justify="right")
        cost.add_column("time", justify="right")
        cost.add_column("at 384 kbit/s (DSL)", justify="right")
        mem = s1.memory
        cost.add_row("suspend on A (256 MiB guest)", f"memory image {human(mem.allocated)} allocated", "",
                     "", f"{s1.save_seconds + s1.seal_seconds:.2f} s", "")
        for label, p in (("push A → B (B had nothing)", p1), ("push B → A (A had the old version)", p2)):
            tt = p.totals()
            cost.add_row(label, human(tt["raw_bytes"]), human(tt["cache_bytes"]), human(p.wire_bytes),
                         f"{p.seconds:.2f} s", f"~{p.wire_bytes / (370_000 / 8):.0f} s")
        cost.add_row("resume on B", "", "", "", f"{r1.seconds:.2f} s", "")
        cost.add_row("resume on A", "", "", "", f"{r2.seconds:.2f} s", "")
        cost.add_row("migrate A → B, demand-paged", "", "", human(m3.remote.get("moved_bytes", 0)) + " first",
                     f"{m3.seconds:.2f} s", f"~{m3.remote.get('moved_bytes', 0) / (370_000 / 8):.0f} s")
        cost.add_row("counter: A → B → A → B", f"{before} → {at_b} → {back} → {at_b2}", "", "", "", "")
        out.print(cost)
        ok = before <= at_b <= back <= at_b2
        out.print("[green]demo OK[/]" if ok else "[red]the counter did not continue[/]")
        if ok and sys.stdin.isatty() and os.environ.get("CAPSULE_DEMO_WAIT", "1") != "0":
            try:
                dashboard(a, b, (url_a, token_a, pin_a), (url_b, token_b, pin_b))
            except Error as exc:            # the optional step: the demo itself went well
                out.print(f"[yellow]the dashboard step did not come up:[/] {exc}")
        return 0 if ok else 1
    finally:
        # the capsules first: a demand-paged one on B reads from A's agent until it stops
        for s in (b, a):
            for name in (NAME, DESK):
                if s.catalogue.instance(name) is not None:
                    lifecycle.stop(s, name, force=True)
        for agent in agents:
            agent.stop()


def dashboard(a: Store, b: Store, agent_a: tuple[str, str, str | None], agent_b: tuple[str, str, str | None]
              ) -> None:
    """Leave both hosts up, each the other's peer, with a desktop capsule running on B beside the demo's,
    and say where the page is: Migrate… moves them (the console follows), until Enter or Ctrl-C."""
    for here, name, (url, token, pin) in ((a, "host-b", agent_b), (b, "host-a", agent_a)):
        for known in hosts.peers(here):       # from an earlier run: its agent's port and key may differ
            if known.name == name or known.url == url:
                hosts.remove(here, known.name)
        hosts.add(here, name, url, token, fingerprint=pin)
    desk = os.environ.get("CAPSULE_DEMO_DESKTOP", "1") != "0"
    if desk:
        t = time.monotonic()
        with out.status("building the desktop image (once: a few minutes) and starting it on B"):
            _row, built = images.build(a, "desktop", "desktop")
            if b.catalogue.image("desktop") is None:
                images.import_image(a, b, "desktop")
            capsules.create(b, DESK, "desktop", memory="1G")
            started = lifecycle.start(b, DESK, timeout=600)
        step(f"B: desktop image {'built' if built else 'ready'}; {DESK} on its graphical session after "
             f"{started.seconds:.0f}s ({time.monotonic() - t:.0f}s in all)")
    out.print(f"\n[bold]The dashboard:[/] open {agent_b[0]}/ and sign in with host B's token:\n  {agent_b[1]}\n"
              + (f"'{DESK}' (a desktop: window manager, terminal, browser) and " if desk else "")
              + f"'{NAME}' (its counter on screen) run there: Console shows a screen; Migrate… → host-a moves a "
              f"capsule with its progress, and the console follows it. Host A's page: {agent_a[0]}/ (token "
              f"{agent_a[1]}).\n"
              + (f"Your browser warns about the hosts' self-signed certificates: host B's fingerprint is "
                 f"{agent_b[2]}, host A's {agent_a[2]}.\n" if agent_b[2] else "")
              + "[dim]Enter or Ctrl-C stops both hosts (CAPSULE_DEMO_WAIT=0 skips this step).[/]")
    with contextlib.suppress(KeyboardInterrupt, EOFError):
        input()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Error as exc:
        out.print(f"[red]demo failed:[/] {exc}")
        sys.exit(1)
