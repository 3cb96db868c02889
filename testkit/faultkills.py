"""SIGKILL of the receiving agent or of `capsule push` in the middle of a push, each kill counted and
measured on its own (for the fault tests and ``bench.faults``).

First the pair's version is pushed whole, unharmed, through a counting :class:`testkit.faultproxy.FaultProxy`
to B's agent (TLS, pinned): this calibrates the kill moments on this machine's speed — the time from the
moment the layer's blocks flow (the proxy has carried ``START`` of its bytes) to the push's end. Then every
draw pushes a fresh version of A's ``cap`` (a new layer of random bytes) with `capsule push`, and once its
blocks flow the victim is SIGKILLed after a delay drawn uniformly over the measured span (the median of the
pushes measured so far: the calibration and every push that ended before its kill), unless the push has
already ended (or, for a kill of the push, had sent its commit: the layer is installed, at once or once
the commit finished verifying): such a draw is *missed* (counted in ``Outcome.missed``; the next draw has a
new layer), so ``times`` kills are all injected mid-transfer, or the outcome says why not. After each kill B
must verify clean with the layer not installed; then the transfer completes (the agent is started again on
the same store and port and the push retries its batches, or, if it gave up, or after the push itself was
killed, a new `capsule push` runs). Per kill: *missing* is what B lacked right after the kill of every layer
the push was sending (its shadows), *resent* every byte the proxy carried toward B on the connections
opened after the kill, until the version was recorded (TLS records, HTTP, the manifest sent again, the
blocks; bytes written after the kill into a killed agent's socket never reached B and are not counted);
``Outcome.worst`` is the largest excess of one kill's resend over its missing bytes."""

from __future__ import annotations

import random
import statistics
import subprocess
import time
from collections.abc import Callable

from capsule import transfer
from capsule.agent.launch import AgentProcess
from capsule.store import Store
from capsule.store.objectio import has_object, object_manifest
from hashcache.blocks import BLOCK_SIZE
from testkit.faultkit import Outcome, agent, arrived, kill, push_cli, sound, top_layer
from testkit.faultproxy import FaultProxy
from testkit.fleetkit import new_version

START = 1 / 8              # of the layer's bytes through the proxy: its blocks are flowing (past the manifest)
SETTLE = 0.3               # s without a byte through the proxy: what a killed push had sent has landed
COMMIT_WAIT = 15.0         # s a commit sent just before the push was killed may take to install


def batch_bytes() -> int:
    """The bytes of one batch of blocks as `capsule push` sends them by default."""
    return transfer.Options().batch * BLOCK_SIZE


def _until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _settled(proxy: FaultProxy, quiet: float = SETTLE, timeout: float = 30.0) -> None:
    """Wait until nothing crossed the proxy for ``quiet`` s."""
    deadline = time.monotonic() + timeout
    last, since = proxy.up, time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.02)
        if proxy.up != last:
            last, since = proxy.up, time.monotonic()


def _completed(proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}): {err.decode()[-2000:]}"


def _lacked(a: Store, b: Store) -> list[str]:
    """The layers of A's latest ``cap`` that B does not hold: what a push of it sends."""
    v = a.catalogue.latest_version("cap")
    assert v is not None
    return [lid for chain in v.chains for lid in chain if not has_object(b, "layer", lid)]


def _raw(a: Store, layers: list[str]) -> int:
    return sum(object_manifest(a, "layer", lid).nonzero_blocks * BLOCK_SIZE for lid in layers)


def _timed_push(a: Store, ag: AgentProcess, proxy: FaultProxy, raw: int) -> float:
    """Push A's ``cap`` unharmed; the seconds from its blocks flowing (``START`` of ``raw``) to its end."""
    up0 = proxy.up
    cli = push_cli(a, ag, proxy.url)
    _until(lambda: proxy.up - up0 >= raw * START or cli.poll() is not None, 120)
    t0 = time.monotonic()
    _completed(cli, "the calibrating push")
    return time.monotonic() - t0


def kills(a: Store, b: Store, victim: str, times: int, size: int, seed: int = 7,
          max_draws: int | None = None) -> Outcome:
    """``times`` SIGKILLs of ``victim`` ('agent': B's agent; 'cli': the push) mid-push, drawn at most
    ``max_draws`` (default 3 × ``times``) times; see the module's docstring."""
    rnd = random.Random(seed)
    out = Outcome(f"SIGKILL {victim} mid-push")
    max_draws = max_draws or 3 * times
    ag = agent(b.home)
    port = ag.port
    draws = 0
    try:
        with FaultProxy("127.0.0.1", port) as proxy:
            spans = [_timed_push(a, ag, proxy, _raw(a, _lacked(a, b)))]
            while out.injected < times and draws < max_draws:
                draws += 1
                new_version(a, "cap", size, seed * 1000 + draws)
                lid = top_layer(a)
                layers = _lacked(a, b)
                raw = _raw(a, layers)
                up0 = proxy.up
                cli = push_cli(a, ag, proxy.url)
                def started(u: int = up0, r: int = raw, c: subprocess.Popen = cli) -> bool:
                    return proxy.up - u >= r * START or c.poll() is not None

                _until(started, 120)
                t0 = time.monotonic()
                time.sleep(rnd.uniform(0.0, statistics.median(spans)))
                if cli.poll() is not None or has_object(b, "layer", lid):
                    out.missed += 1   # the push ended before the kill: no fault mid-transfer
                    _completed(cli, f"draw {draws}: the push")
                    spans.append(time.monotonic() - t0)
                    continue
                if victim == "agent":
                    kill(ag)
                else:
                    kill(cli)
                    _settled(proxy)   # the agent takes in what the push had sent before it died
                    if sum(arrived(b, a, layer) for layer in layers) == raw:
                        # every block arrived: the commit may have been sent and still be verifying
                        def installed(i: str = lid) -> bool:
                            return has_object(b, "layer", i)

                        _until(installed, COMMIT_WAIT)
                    if has_object(b, "layer", lid):   # its commit had been sent: the kill came after it
                        out.missed += 1
                        continue
                out.injected += 1
                have = sum(arrived(b, a, layer) for layer in layers)
                proxy.mark()   # what is resent crosses on new connections: to the agent started again, or to the rerun
                problems = sound(b) + (["the layer was installed by a killed push"]
                                       if has_object(b, "layer", lid) else [])
                if victim == "agent":
                    ag = agent(b.home, port)   # the push retries its batches meanwhile, or gives up
                    if cli.wait(180) != 0:
                        _completed(push_cli(a, ag, proxy.url), f"kill {out.injected}: the push run again")
                else:
                    _completed(push_cli(a, ag, proxy.url), f"kill {out.injected}: the push run again")
                if not has_object(b, "layer", lid):
                    problems.append("the layer is not installed after the push completed")
                problems += sound(b)
                if problems:
                    out.detail = out.detail or f"kill {out.injected}: {problems[0]}"
                else:
                    out.survived += 1
                missing, resent = raw - have, proxy.up_new
                out.worst = resent - missing if out.injected == 1 else max(out.worst, resent - missing)
                out.missing += missing
                out.resent += resent
    finally:
        ag.stop()
    if out.injected < times:
        out.detail = out.detail or (f"only {out.injected} of {times} kills landed mid-transfer in {draws} draws "
                                    f"(kill moments drawn over {statistics.median(spans):.2f} s, the median "
                                    f"push measured)")
    return out
