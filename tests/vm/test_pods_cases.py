"""Laadan–Nieh's multi-process cases of a pod's checkpoint and restart, each its own test. One Debian capsule (pa
of the pod tests' shared pair) serves the module; each case is its own pod (its program: podcasekit), which sets
its state up and reports it, is checkpointed (it dies) and restored in the same capsule, then goes on and
reports what it found. The state must be exactly as it was and go on; where CRIU keeps less, the test pins what
it keeps, and where it refuses, the test asserts that Capsule's error carries CRIU's own message and that the
pod runs on.

What CRIU (3.17.1 in the Debian guest, kernel 6.1) does with each case:

=============================================================  ==========================================
case                                                           CRIU
=============================================================  ==========================================
pipes: 48 KiB in flight; a reader asleep in read(2)            covered
UNIX stream and datagram pairs, bytes in flight; a named       covered
listener reached by a new client
UNIX connection still in a listener's backlog, bytes sent      kept, but the bytes sent before the accept
                                                               are lost (the connection works after)
shared memory: MAP_SHARED anonymous; POSIX shm in /dev/shm     covered
POSIX shm unlinked once mapped (shm_unlink), 4 MiB             covered (the pod layer carries deleted
                                                               files up to 64 MiB: ``--ghost-limit``)
the same, 65 MiB                                               refused: "Can't dump ghost file
                                                               /dev/shm/pod-big of 68157440 size,
                                                               increase limit"
signals in flight: blocked SIGUSR1 (process) and SIGUSR2       covered
(thread) pending; a realtime queue with values
timers: setitimer, timer_create, an armed timerfd              covered (period and time left kept)
a periodic timerfd whose expiry is due, unread, at the dump    kept: the due expiry reads, and it fires
                                                               again at its period (CRIU restores it
                                                               disarmed, criu issue #3162; the pod layer
                                                               arms it again: pods/timerfds.py)
a pty: a session on it, output unread, its window size         covered (the pod mounts its own devpts: a
                                                               pod has no /dev/pts)
inotify: a watch reports an event made after the restore       covered; events queued unread at the dump
                                                               are lost
eventfd: a counter's value; a reader asleep in read(2)         covered; EFD_SEMAPHORE is lost (kernel
                                                               6.1's fdinfo does not show it): a read
                                                               takes the whole count
a process tree with zombies (exit status, killed), a subtree   covered (PIDs, parents, groups, sessions)
file locks: flock(2) and a POSIX record lock                   covered (``--file-locks``)
=============================================================  ==========================================
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from capsule.errors import Error
from capsule.pod import ops
from capsule.pod.errors import CheckpointFailed
from capsule.pod.relay import Relay
from capsule.runtime.connection import lookup_domain
from capsule.store import Store
from tests.vm.podcasekit import program

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(300)]

CAPSULE = "pa"   # the first capsule of the pod tests' shared pair (tests/vm/podpair.py)
WAIT = "for i in $(seq 600); do [ -e {path} ] && exec cat {path}; sleep 0.1; done; echo 'no {path}' >&2; exit 1"
GHOST = "Can't dump ghost file /dev/shm/pod-big of 68157440 size, increase limit"   # CRIU's refusal
SECONDS: dict[str, tuple[float, float, float]] = {}   # per case: CRIU's dump, the checkpoint, the restore


@pytest.fixture(scope="module")
def pods(module_pod_pair) -> Iterator[Store]:
    """One running Debian capsule for every case of the module: pa of the shared pair, with no pods when the
    module starts; each case kills its pod (``_pod``), and the pair is made clean after the last."""
    yield module_pod_pair.store
    for case, (dump, ck, rs) in SECONDS.items():
        print(f"{case:14} checkpoint {ck:5.2f} s (CRIU's dump {dump:5.2f} s)   restore {rs:5.2f} s")


def _ref(case: str) -> str:
    return f"{CAPSULE}/{case}"


def _report(store: Store, case: str, path: str, first: str = "") -> dict:
    """What the pod wrote to ``path`` (waiting for it), after running ``first`` in it."""
    r = ops.exec_in(store, _ref(case), ["sh", "-c", first + WAIT.format(path=path)], timeout=90)
    assert r["exit_code"] == 0, f"{case}: {r['stderr']}"
    out = json.loads(r["stdout"])
    assert "error" not in out, out["error"]
    return out


@contextlib.contextmanager
def _pod(store: Store, case: str) -> Iterator[dict]:
    """Pod ``case`` started with its program; its first report given; killed at the end."""
    Relay(store, CAPSULE).sh(f"cat > /root/{case}.py", stdin=program(case))
    try:
        ops.create(store, CAPSULE, case, ["python3", f"/root/{case}.py"])
        yield _report(store, case, "/tmp/ready.json")
    finally:
        with contextlib.suppress(Error):
            ops.kill(store, _ref(case))


def _restart(store: Store, case: str) -> None:
    """Checkpoint the pod (its processes die with it) and restore it in the same capsule."""
    ck = ops.checkpoint(store, _ref(case))
    assert not ck.left_running
    assert case not in {p["name"] for p in ops.ls(store, CAPSULE)}
    back = ops.restore(store, ck.image, CAPSULE)
    assert back["state"] == "running"
    SECONDS[case] = (ck.dump_seconds, ck.seconds, back["seconds"])


def run_case(store: Store, case: str) -> tuple[dict, dict]:
    """Pod ``case``'s report before its checkpoint and after its restore (it goes on once told)."""
    with _pod(store, case) as ready:
        _restart(store, case)
        return ready, _report(store, case, "/tmp/result.json", first="touch /tmp/go; ")


def test_pipes_bytes_in_flight_come_out_once_and_a_reader_asleep_in_read_wakes(pods):
    ready, after = run_case(pods, "pipes")
    assert (ready["reader_state"], ready["reader_syscall"]) == ("S", "0")   # 0: read(2) on x86-64
    assert {k: after[k] for k in ready} == ready            # same PID, asleep in read(2); all 48 KiB, exact
    assert after["more"] is False and after["again"] == "and a write after the restore"
    assert (after["reader_got"], after["reader_exit"]) == ("woken after the restore", 0)


def test_unix_stream_and_datagram_pairs_keep_their_bytes_and_a_named_listener_its_name(pods):
    ready, after = run_case(pods, "unix")
    assert after["peer"] == {"sha": ready["sha"], "n": ready["n"], "grams": ["first datagram", "second"]}
    assert after["replies"] == ["reply on the stream", "reply datagram"]
    assert after["named"] == "new connection"


def test_a_unix_connection_in_the_backlog_is_kept_but_its_bytes_sent_before_the_accept_are_lost(pods):
    _, after = run_case(pods, "unix-pending")
    assert after == {"early": None, "later": "sent after the restore", "back": "and back"}


def test_shared_memory_anonymous_and_posix_keeps_its_bytes_and_stays_shared(pods):
    ready, after = run_case(pods, "shm")
    assert after["anon"] >= ready["anon"] and after["posix"] >= ready["posix"]
    assert (after["anon_marker"], after["posix_marker"]) == ("anonymous marker", "posix shm marker")
    assert after["rising"] is True                                 # the child writes, the parent sees it
    assert after["fresh"] == "posix shm marker" and after["fresh_count_at_least"] is True


def test_posix_shm_unlinked_once_mapped_comes_back_whole(pods):
    ready, after = run_case(pods, "shm-unlinked")
    assert ready == {"size": 4 << 20}
    assert after == {"marker": "still mapped", "tail": "tail"}


def test_a_deleted_file_over_the_limit_is_refused_with_criu_s_own_error_and_the_pod_runs_on(pods):
    case = "shm-unlinked-huge"
    with _pod(pods, case) as ready:
        assert ready == {"size": 65 << 20}
        with pytest.raises(CheckpointFailed) as refused:
            ops.checkpoint(pods, _ref(case))
        message = str(refused.value)
        assert "criu dump failed" in message and GHOST in message and "larger than the 64 MiB" in message
        assert refused.value.code == "pod_checkpoint_failed"
        # and as `capsule pod checkpoint` shows it: CRIU's words, the checkpoint's exit code
        shown = subprocess.run([sys.executable, "-m", "capsule.cli.main", "pod", "checkpoint", _ref(case)],
                               capture_output=True, text=True, timeout=180,
                               env=dict(os.environ, CAPSULE_HOME=str(pods.home), COLUMNS="500"))
        assert shown.returncode == CheckpointFailed.exit_code, shown.stderr
        assert GHOST in " ".join(shown.stderr.split()), shown.stderr
        assert ops.source_pod(pods, _ref(case))["state"] == "running"
        after = _report(pods, case, "/tmp/result.json", first="touch /tmp/go; ")
        assert after == {"marker": "still mapped", "tail": "tail"}


def test_signals_in_flight_stay_pending_and_are_delivered_after_the_restore(pods):
    ready, after = run_case(pods, "signals")
    rt = after["rt"]
    assert ready["pending"] == [signal.SIGUSR1, signal.SIGUSR2, rt] and ready["delivered"] == []
    assert {k: after[k] for k in ("pending", "SigPnd", "ShdPnd", "SigBlk")} == \
        {k: ready[k] for k in ("pending", "SigPnd", "ShdPnd", "SigBlk")}
    # the realtime queue in order, each with its value and its sender (si_code SI_QUEUE)
    assert after["rt_queue"] == [[rt, after["si_queue"], ready["pid"], v] for v in (11, 22, 33)]
    assert after["left"] == [signal.SIGUSR1, signal.SIGUSR2]
    assert after["delivered"] == ["SIGUSR1", "SIGUSR2", "SIGUSR1"]


def test_interval_timers_keep_firing_at_their_period_after_the_restore(pods):
    ready, after = run_case(pods, "timers")
    assert ready["intervals"] == after["intervals"] == after["periods"]
    for name, period in after["periods"].items():
        assert abs(after["measured"][name] - period) <= 0.2 * period, (name, after["measured"])
        assert after["counts"][name] >= 0.6 * 2.5 / period, (name, after["counts"])
    # an armed timerfd: its interval, and its time left counting on from where it was
    assert after["timerfd"]["interval"] == ready["timerfd"]["interval"] == 60.0
    assert 0 < after["timerfd"]["value"] < ready["timerfd"]["value"]


def test_a_periodic_timerfd_due_at_the_dump_keeps_firing_after_the_restore(pods):
    ready, after = run_case(pods, "timerfd-due")
    due = {"ticks": "1", "it_value": "(0, 0)", "it_interval": "(0, 200000000)"}
    assert {k: ready["fdinfo"][k] for k in due} == due               # firing, its expiry unread
    assert after["fdinfo"]["it_interval"] == due["it_interval"] and int(after["fdinfo"]["ticks"]) >= 1
    assert after["pending"] >= 1                                     # the due expiry (and any since) reads
    assert after["fired_again"] is True                              # and it fires again at its period
    assert after["gettime"]["interval"] == 0.2 and 0 < after["gettime"]["value"] <= 0.2


def test_a_session_on_a_pty_keeps_its_terminal_its_unread_output_and_its_window_size(pods):
    ready, after = run_case(pods, "pty")
    child = ready["child"]
    assert ready["tty"] == "/dev/pts/0"
    assert ready["child_stat"]["session"] == child and ready["child_stat"]["tty"] != 0   # its controlling tty
    assert after["child_stat"] == ready["child_stat"]
    assert after["unread"] == "output nobody has read yet\n"
    assert after["winsize"] == [33, 77]
    assert (after["answer"], after["exit"]) == ("got input after the restore\n", 0)


def test_an_inotify_watch_reports_an_event_made_after_the_restore(pods):
    ready, after = run_case(pods, "inotify")
    in_create = 0x100
    assert ready["first"] == [[ready["wd"], in_create, "before"]]
    assert after["queued"] == []                                     # CRIU keeps no queued event
    assert after["after"] == [[ready["wd"], in_create, "after-restore"]]


def test_an_eventfd_keeps_its_count_and_wakes_its_reader(pods):
    ready, after = run_case(pods, "eventfd")
    assert ready["semaphore"] == [1]                                 # a semaphore before the dump
    assert after["counter"] == 42 and after["waiter_got"] == "9"
    assert after["semaphore"] == [1, 2, "empty", "empty"]            # after it: a plain counter (2 left)


def test_a_process_tree_keeps_its_pids_its_shape_and_its_zombies_exit_statuses(pods):
    ready, after = run_case(pods, "tree")
    assert after["pids"] == ready["pids"]
    shape = ("ppid", "pgrp", "session")
    assert {n: {k: s[k] for k in shape} for n, s in after["tree"].items()} == \
        {n: {k: s[k] for k in shape} for n, s in ready["tree"].items()}
    for name in ("zombie", "killed", "own"):
        assert ready["tree"][name]["state"] == after["tree"][name]["state"] == "Z"
    assert after["statuses"] == {"zombie": 7, "killed": -signal.SIGKILL, "own": 3, "new": 5}
    assert after["sleeper_alive"] is True


def test_file_locks_stay_held_and_are_freed_by_their_holder(pods):
    ready, after = run_case(pods, "locks")
    assert ready == {"flock_free": False, "posix_free": False}
    assert after == {**ready, "freed": [True, True]}


def test_a_pod_image_s_way_in_and_out_on_a_lent_disk_keeps_the_bytes_and_gives_the_disk_back(pods, tmp_path):
    # big pod images take it; the disk given back, so the capsule has its own disks only (a suspend's
    # restore XML admits no other)
    relay = Relay(pods, CAPSULE)
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(20 << 20) + b"tail")
    assert relay.upload(blob, "/root/blob", lend=True) == 1
    back_here = tmp_path / "back"
    assert relay.download("/root/blob", blob.stat().st_size, back_here, lend=True) == 1
    assert back_here.read_bytes() == blob.read_bytes()
    domain = lookup_domain(pods.catalogue.instance(CAPSULE).domain)
    assert domain is not None and domain.XMLDesc(0).count("<disk ") == 1
