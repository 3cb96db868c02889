"""Commands run inside an update's guest through its agent (guest-balloon/PROTOCOL.md), with their output live.

The agent's ``exec`` answers only when the command has ended, with all its output at once: fine for the
short steps here (network, scratch mounts, ``fstrim``), not for an ``apt-get`` that runs for minutes. So a
long command is started detached (``setsid -f``, its own process group) writing its output to a file on
the guest's ``/run`` (tmpfs: nothing of it reaches the disk), and the host polls that file through the
agent twice a second, by byte offset, base64 on the wire (exact bytes whatever the command prints), until
the exit status appears. A command that outlives its timeout is killed with its whole group. The serial
console is not used: it is the user's (``capsule console``), and it carries no exit status."""

from __future__ import annotations

import base64
import codecs
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capsule.errors import GuestTimeout
from capsule.runtime.guestagent import AgentError, GuestAgent

RUN_DIR = "/run/capsule-update"
POLL_SECONDS = 0.5
CHUNK = 512 << 10                      # output bytes per poll (base64 stays under exec's 1 MiB reply cap)
ENV = "export DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 HOME=/root PATH=/usr/local/sbin:/usr/local/bin:" \
      "/usr/sbin:/usr/bin:/sbin:/bin"
# apt's scratch space: what it downloads (the .debs, its package cache) and its list files live in RAM for
# the run and are gone when it ends, so none of it reaches the new layer
APT_SCRATCH = ("/var/cache/apt", "/var/lib/apt/lists")

Output = Callable[[str], None]

# the detached runner: $1 the script, $2 the path prefix of its files (.pid .out .rc)
_RUNNER = ('exec >/dev/null 2>&1 </dev/null; echo $$ > "$2.pid"; ' + ENV + '; cd /root 2>/dev/null || cd /; '
           'sh -c "$1" > "$2.out" 2>&1; echo $? > "$2.rc.tmp"; mv "$2.rc.tmp" "$2.rc"')
# one poll: "<rc or -> <size> <end>", then base64 of bytes [$2, end) of the output
_POLL = ('r=-; [ -e "$1.rc" ] && r=$(cat "$1.rc"); s=$(stat -c %s "$1.out" 2>/dev/null || echo 0); '
         f'e=$s; [ $((e - $2)) -gt {CHUNK} ] && e=$(($2 + {CHUNK})); echo "$r $s $e"; '
         '[ "$e" -gt "$2" ] && tail -c +$(($2 + 1)) "$1.out" | head -c $((e - $2)) | base64 -w0; true')


@dataclass
class StepResult:
    label: str
    exit_code: int
    seconds: float
    output_bytes: int


class GuestShell:
    """Short commands (``sh``, through ``exec``) and long, live ones in one guest."""

    def __init__(self, agent_socket: Path) -> None:
        self.socket = agent_socket
        self._n = 0

    def sh(self, script: str, timeout: float = 60.0) -> str:
        """Run a short script; its stdout, or AgentError with its output if it fails."""
        with GuestAgent(self.socket, timeout=10) as agent:
            r = agent.exec(["sh", "-c", f"{ENV}; {script}"], timeout_s=timeout)
        if r.get("timed_out"):
            raise GuestTimeout(f"the guest did not finish {script.split(';')[0]!r} within {timeout:.0f} s")
        if r.get("exit_code") != 0:
            out = (r.get("stderr") or "") + (r.get("stdout") or "")
            raise AgentError(f"in the guest, `{script.splitlines()[0][:80]}` failed "
                             f"(exit {r.get('exit_code')}): {out.strip()[-600:]}")
        return str(r.get("stdout", ""))

    def run(self, label: str, script: str, output: Output, timeout: float) -> StepResult:
        """Run ``script`` detached, passing its output to ``output`` as it comes; its exit status."""
        self._n += 1
        prefix = f"{RUN_DIR}/step{self._n}"
        self.sh(f"mkdir -p {RUN_DIR} && setsid -f sh -c {shlex.quote(_RUNNER)} sh {shlex.quote(script)} {prefix}")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset, t0 = 0, time.monotonic()
        deadline = t0 + timeout
        while True:
            with GuestAgent(self.socket, timeout=10) as agent:
                r = agent.exec(["sh", "-c", _POLL, "sh", prefix, str(offset)], timeout_s=30)
            head, _, data = str(r.get("stdout", "")).partition("\n")
            try:
                if r.get("timed_out") or r.get("exit_code") != 0:
                    raise ValueError(f"exit {r.get('exit_code')}")
                rc_s, size_s, end_s = head.split()
                chunk = base64.b64decode(data.strip()) if data.strip() else b""
                offset, size = int(end_s), int(size_s)
                rc = None if rc_s == "-" else int(rc_s)
            except ValueError as exc:      # (binascii.Error is a ValueError)
                raise AgentError(f"{label}: reading the command's output from the guest failed ({exc}): "
                                 f"{(head + str(r.get('stderr', '')))[:300]}") from exc
            if chunk:
                output(decoder.decode(chunk))
            if rc is not None and offset >= size:
                output(decoder.decode(b"", final=True))
                return StepResult(label, rc, time.monotonic() - t0, offset)
            if time.monotonic() > deadline:
                self.sh(f'kill -KILL -- -"$(cat {prefix}.pid)" 2>/dev/null; true')
                raise GuestTimeout(f"{label}: still running after {timeout:.0f} s; killed (raise --timeout)")
            if offset >= size:
                time.sleep(POLL_SECONDS)

    # -- the update's set-up and clean-up -------------------------------------------------------------------
    def network_up(self, network: str) -> None:
        """Configure the NIC on QEMU's user network (``domainxml.add_user_network``): its address, the
        gateway, and the DNS forwarder in a resolv.conf mounted over /etc/resolv.conf (nothing on disk).
        udev may still be renaming the NIC (eth0 → ens3) while the guest boots: the script waits for udev,
        and takes the NIC once it could bring it up under its name (an interface that is up is not
        renamed)."""
        base, _, prefix = network.partition("/")
        net = base.rsplit(".", 1)[0]
        self.sh(
            "udevadm settle -t 10 2>/dev/null; "
            "i=0; while :; do dev=; for p in /sys/class/net/*; do n=${p##*/}; [ \"$n\" = lo ] || dev=$n; done; "
            "[ -n \"$dev\" ] && ip link set \"$dev\" up 2>/dev/null && break; i=$((i+1)); "
            "[ $i -gt 100 ] && { echo \"no network interface came up (last seen: ${dev:-none})\" >&2; "
            "exit 1; }; sleep 0.1; done; "
            f"ip addr add {net}.15/{prefix} dev \"$dev\" && "
            f"ip route add default via {net}.2 && mkdir -p {RUN_DIR} && "
            f"echo 'nameserver {net}.3' > {RUN_DIR}/resolv.conf && mount --bind {RUN_DIR}/resolv.conf /etc/resolv.conf",
            timeout=30)

    def scratch_up(self) -> list[str]:
        """tmpfs over apt's download and list directories (those that exist); the mounted ones."""
        script = "; ".join(
            f"if [ -d {d} ]; then mount -t tmpfs -o mode=0755 capsule-apt {d} && echo {d}; fi" for d in APT_SCRATCH)
        mounted = self.sh(f"set -e; {script}; mkdir -p /var/cache/apt/archives/partial /var/lib/apt/lists/partial "
                          "2>/dev/null; true").split()
        return mounted

    def scratch_down(self, mounted: list[str], network: bool) -> tuple[int, int]:
        """(bytes of .debs apt left in its cache, bytes of its list files), then ``apt-get clean`` and the
        scratch space dropped; the resolv.conf mount too."""
        out = self.sh(
            "debs=$(find /var/cache/apt/archives -name '*.deb' -printf '%s\\n' 2>/dev/null | "
            "awk '{s+=$1} END {print s+0}'); lists=$(find /var/lib/apt/lists -type f -printf '%s\\n' 2>/dev/null | "
            "awk '{s+=$1} END {print s+0}'); "
            "echo \"$debs ${lists:-0}\"; command -v apt-get >/dev/null && apt-get clean; "
            + "".join(f"umount {d}; " for d in mounted)
            + ("umount /etc/resolv.conf; " if network else "") + "true", timeout=120)
        debs, lists = (int(x) for x in out.split()[:2])
        return debs, lists

    def forget_machine_id(self) -> None:
        """Empty /etc/machine-id again (systemd wrote one at the update's boot): every capsule booted from
        the update makes its own, instead of all of a fleet's sharing the update guest's."""
        self.sh("if [ -s /etc/machine-id ]; then : > /etc/machine-id; fi")

    def trim(self) -> int:
        """``sync`` and ``fstrim`` every mounted file system that takes it; bytes trimmed."""
        out = self.sh("sync; fstrim -av 2>&1; sync", timeout=600)
        return sum(int(m) for m in re.findall(r"\((\d+) bytes\) trimmed", out))


NEED_TO_GET = re.compile(r"Need to get ([\d.,]+) ?([kMGT]?B)(?:/([\d.,]+) ?([kMGT]?B))? of archives")
_UNIT = {"B": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}


def need_to_get(text: str) -> int:
    """Bytes apt said it would download ("Need to get 389 kB of archives.", "Need to get 0 B/389 kB …":
    the first figure), summed over every apt run in ``text``. apt rounds to 4 significant digits."""
    total = 0
    for m in NEED_TO_GET.finditer(text):
        total += round(float(m.group(1).replace(",", "")) * _UNIT[m.group(2)])
    return total
