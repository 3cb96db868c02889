"""nftables through libnftables (CRIU's own dependency; the guest has no ``nft`` binary).

``python3 -m pods.nft unlock`` (run inside a pod's network namespace) removes the lock tables a
checkpoint left: CRIU names its lock table after the root task's PID at dump time, so the restore,
whose root has another PID in the capsule, cannot find it and the pod would stay cut off."""

from __future__ import annotations

import ctypes
import re
import sys

LOCK_TABLE = re.compile(r"^table inet (CRIU-\d+)", re.M)


def run(command: str) -> str:
    lib = ctypes.CDLL("libnftables.so.1")
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error", "nft_ctx_get_output_buffer",
               "nft_ctx_get_error_buffer", "nft_ctx_free"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ctx = lib.nft_ctx_new(0)
    try:
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        rc = lib.nft_run_cmd_from_buffer(ctx, command.encode())
        out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
        if rc != 0:
            raise OSError(f"nft {command}: {(lib.nft_ctx_get_error_buffer(ctx) or b'').decode().strip()}")
        return out
    finally:
        lib.nft_ctx_free(ctx)


GUARD_TABLE = "pods_uplink"


def guard_gateway(uplink: str, gateway: str) -> None:
    """Every capsule's pods0 holds the same gateway address; on the shared segment only the capsule's own
    may answer for it: ARP for the gateway neither leaves through the uplink nor is answered from it,
    and the capsule's own traffic from the gateway address stays inside."""
    run(f"add table bridge {GUARD_TABLE}")
    run(f"flush table bridge {GUARD_TABLE}")
    for chain, hook in (("to_uplink", "forward"), ("from_uplink", "input"), ("from_capsule", "output")):
        run(f"add chain bridge {GUARD_TABLE} {chain} {{ type filter hook {hook} priority 0; policy accept; }}")
    run(f'add rule bridge {GUARD_TABLE} to_uplink oifname "{uplink}" arp daddr ip {gateway} drop')
    run(f'add rule bridge {GUARD_TABLE} from_uplink iifname "{uplink}" arp daddr ip {gateway} drop')
    run(f'add rule bridge {GUARD_TABLE} from_capsule oifname "{uplink}" arp saddr ip {gateway} drop')
    run(f'add rule bridge {GUARD_TABLE} from_capsule oifname "{uplink}" ip saddr {gateway} drop')


def unlock() -> list[str]:
    tables = LOCK_TABLE.findall(run("list tables"))
    for table in tables:
        run(f"delete table inet {table}")
    return tables


if __name__ == "__main__":
    if sys.argv[1:] != ["unlock"]:
        sys.exit("usage: python3 -m pods.nft unlock")
    print(" ".join(unlock()))
