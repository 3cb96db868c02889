"""Running the agent: token handling and uvicorn."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from capsule.errors import InvalidName
from capsule.names import check_host


def ensure_token(token_file: Path) -> str:
    """Read the agent's token, creating the file (mode 0600) with a fresh one if missing."""
    if not token_file.exists():
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    token = token_file.read_text().strip()
    if len(token) < 16:
        raise InvalidName(f"the token in {token_file} is shorter than 16 characters")
    return token


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    # ASCII digits only: str.isdigit() also takes other scripts' digits ('١') and superscripts ('²')
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise InvalidName(f"--listen {listen!r}: expected HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return check_host(host or "127.0.0.1", f"--listen host in {listen!r}"), int(port)


def serve(home: Path, listen: str, token_file: Path) -> None:
    import uvicorn

    from capsule.agent.app import create_app

    host, port = parse_listen(listen)
    app = create_app(home, ensure_token(token_file))
    from capsule.backup.scheduler import start_in_serve
    start_in_serve(home)  # scheduled backups run inside the agent (capsule/backup/scheduler.py)
    uvicorn.run(app, host=host, port=port, log_level=os.environ.get("CAPSULE_LOG_LEVEL", "warning"),
                access_log=False, server_header=False, date_header=False,
                # keep idle connections well past a batch's round trip on a slow link: reopening one
                # there means a SYN that may wait behind a full queue
                timeout_keep_alive=75)
