"""A real SeaweedFS cluster on loopback for the capsule repository's tests and benchmarks: one master, two
volume servers, a filer and its S3 gateway (the ``weed`` binary that ``scripts/seaweedfs.sh`` builds and
caches), in a temporary directory, with one S3 identity. Every process runs in a session of its own and is
ended with its group.

``python -m testkit.seaweedfs serve DIR PORT`` runs one in the foreground, its S3 gateway on 127.0.0.1:PORT and
its data and S3 identity (``DIR/credentials.json``, made once) kept in DIR: the compose file's object store."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from testkit.processes import stop_groups

ROOT = Path(__file__).resolve().parents[1]
GRPC_OFFSET = 10000    # SeaweedFS listens for gRPC on each HTTP port + 10000


def weed_binary() -> Path:
    """The cached ``weed`` (``CAPSULE_WEED`` if set), built by scripts/seaweedfs.sh when missing."""
    if os.environ.get("CAPSULE_WEED"):
        return Path(os.environ["CAPSULE_WEED"])
    found = subprocess.run(["bash", str(ROOT / "scripts" / "seaweedfs.sh"), "--path"], capture_output=True, text=True)
    if found.returncode != 0:
        built = subprocess.run(["bash", str(ROOT / "scripts" / "seaweedfs.sh")], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"SeaweedFS could not be built: {built.stderr[-2000:]}")
        found = built
    return Path(found.stdout.strip().splitlines()[-1])


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies (a crashed test run leaves no servers behind)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG


def port_pair() -> int:
    """A loopback port free together with its gRPC port (+10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + GRPC_OFFSET))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port pair for SeaweedFS")


class SeaweedCluster:
    """``start()``; ``endpoint`` (http://127.0.0.1:PORT), ``access_key``/``secret_key``; ``stop()``."""

    def __init__(self, workdir: Path, *, volumes: int = 2, replication: str = "000", s3_port: int = 0,
                 access_key: str | None = None, secret_key: str | None = None) -> None:
        self.workdir = workdir
        self.volumes = volumes
        self.replication = replication
        self.fixed_s3_port = s3_port
        self.access_key = access_key or "capsule-" + secrets.token_hex(4)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.procs: list[subprocess.Popen[Any]] = []
        self.roles: list[str] = []
        self.args: dict[str, tuple[str, ...]] = {}
        self.master_port = self.filer_port = self.s3_port = 0
        self.volume_ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"s3+http://127.0.0.1:{self.s3_port}/{bucket}" + (f"/{prefix}" if prefix else "")

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def _run(self, name: str, *args: str) -> subprocess.Popen[Any]:
        self.args[name] = args
        log = open(self.workdir / f"{name}.log", "ab")   # noqa: SIM115 - the process holds it
        p = subprocess.Popen([str(self.weed), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=self.workdir, preexec_fn=_die_with_parent)
        log.close()
        self.procs.append(p)
        self.roles.append(name)
        return p

    def start(self, timeout: float = 90.0) -> SeaweedCluster:
        self.weed = weed_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        s3_config = self.workdir / "s3.json"
        s3_config.write_text(json.dumps({"identities": [{
            "name": "capsule", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.master_port = port_pair()
        (self.workdir / "master").mkdir(exist_ok=True)
        self._run("master", "master", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={self.master_port}",
                  f"-mdir={self.workdir / 'master'}", "-volumeSizeLimitMB=64",
                  f"-defaultReplication={self.replication}")
        master = f"127.0.0.1:{self.master_port}"
        for i in range(self.volumes):
            port = port_pair()
            self.volume_ports.append(port)
            d = self.workdir / f"volume{i}"
            d.mkdir(exist_ok=True)
            self._run(f"volume{i}", "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={port}",
                      f"-dir={d}", f"-mserver={master}", "-max=100", "-dataCenter=dc1", f"-rack=rack{i}")
        self.filer_port = port_pair()
        (self.workdir / "filer").mkdir(exist_ok=True)
        self._run("filer", "filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={self.filer_port}",
                  f"-master={master}", f"-defaultStoreDir={self.workdir / 'filer'}")
        self.s3_port = self.fixed_s3_port or port_pair()
        self._run("s3", "s3", "-ip.bind=127.0.0.1", f"-port={self.s3_port}",
                  f"-filer=127.0.0.1:{self.filer_port}", f"-config={s3_config}", "-port.iceberg=0",
                  "-port.lance=0")
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the S3 gateway stores and returns an object (every server up, volumes assigned)."""
        from capsule.errors import Error
        from capsule.repo.s3 import Credentials, S3Client, parse_url

        client = S3Client(parse_url(self.url("readiness")), Credentials(self.access_key, self.secret_key),
                          timeout=10)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                for p, role in zip(self.procs, self.roles, strict=True):
                    if p.poll() is not None:
                        raise RuntimeError(f"SeaweedFS's {role} exited: see {self.workdir}/{role}.log")
                try:
                    if not client.bucket_exists():
                        client.create_bucket()
                    client.put("probe", b"ready")
                    if client.get("probe") == b"ready":
                        return
                except Error as exc:
                    last = exc
                time.sleep(0.5)
        finally:
            client.close()
        raise RuntimeError(f"SeaweedFS did not become ready in {timeout:.0f}s: {last}")

    def kill(self, role: str) -> None:
        """Kill one server (``s3``, ``filer``, ``master``, ``volume0`` …) at once, as a crash would."""
        i = self.roles.index(role)
        proc = self.procs.pop(i)
        self.roles.pop(i)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, role: str, timeout: float = 60.0) -> None:
        """Start a killed server again, as it was, and wait until the store answers."""
        self._run(role, *self.args[role])
        self._wait_ready(timeout)

    def stop(self) -> None:
        stop_groups(self.procs)
        self.roles.clear()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


CREDENTIALS = "credentials.json"
SERVE_REPLICATION = "010"     # the compose file's object store: a copy in each of its two racks


def serve(workdir: Path, s3_port: int) -> None:
    """A cluster in the foreground until SIGTERM: its S3 gateway on 127.0.0.1:``s3_port``, its data in
    ``workdir``, its S3 identity ``workdir/credentials.json`` (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``),
    made on the first start and kept; ``workdir/ready`` once it stores and returns an object."""
    workdir.mkdir(parents=True, exist_ok=True)
    creds = workdir / CREDENTIALS
    if not creds.exists():
        keys = {"AWS_ACCESS_KEY_ID": "capsule-" + secrets.token_hex(4), "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20)}
        tmp = creds.with_suffix(".tmp")
        tmp.write_text(json.dumps(keys))
        tmp.chmod(0o600)
        tmp.rename(creds)
    keys = json.loads(creds.read_text())
    (workdir / "ready").unlink(missing_ok=True)
    # "010": each volume also on the volume server of the other rack, so losing one loses nothing (what
    # tests/tools/test_repo_seaweedfs.py's lost-volume-server test checks); "000" would lose its volumes
    cluster = SeaweedCluster(workdir, s3_port=s3_port, access_key=keys["AWS_ACCESS_KEY_ID"],
                             secret_key=keys["AWS_SECRET_ACCESS_KEY"], replication=SERVE_REPLICATION)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    cluster.start(timeout=180)
    (workdir / "ready").write_text(cluster.endpoint)
    print(f"SeaweedFS: S3 on {cluster.endpoint}, master {cluster.master_port}, volumes {cluster.volume_ports}",
          flush=True)
    try:
        told: set[str] = set()
        while not stopping:
            down = {r for p, r in zip(cluster.procs, cluster.roles, strict=True) if p.poll() is not None}
            if down - {r for r in cluster.roles if r.startswith("volume")}:
                raise SystemExit(f"SeaweedFS's {', '.join(sorted(down))} exited: see {workdir}/*.log")
            for role in sorted(down - told):     # its replicas serve what it held: reads go on, degraded
                print(f"SeaweedFS's {role} exited (see {workdir}/{role}.log); its volumes' replicas serve on, "
                      "and writes that need both racks fail until it is back", flush=True)
            told |= down
            time.sleep(1)
    finally:
        (workdir / "ready").unlink(missing_ok=True)
        cluster.stop()


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit("usage: python -m testkit.seaweedfs serve DIR PORT")
    serve(Path(sys.argv[2]), int(sys.argv[3]))
