"""The pod layer that runs inside a capsule (Zap-style pods on namespaces, cgroup v2 and CRIU).

Runs on the guest's python3 with the standard library only; the host drives it through the
guest agent (``capsule/pods.py``). ``python3 -m pods`` is its command line (JSON out)."""

VERSION = "0.1.0"
