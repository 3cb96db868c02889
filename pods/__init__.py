"""The pod layer that runs inside a capsule (Zap-style pods on namespaces, cgroup v2 and CRIU).

Runs on the guest's python3 with the standard library only; the host drives it through the
guest agent (``capsule/pods.py``). ``python3 -m pods`` is its command line (JSON out)."""

VERSION = "0.2.0"
# what the host may ask of this pod layer beyond 0.1.0's verbs: "direct" — `checkpoint --to DEVICE`,
# `restore DEVICE --size N --md5 H`, `drop` and `restore-dump` (the image straight on a lent disk)
FEATURES = ("direct",)
