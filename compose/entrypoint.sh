#!/usr/bin/env bash
# A Capsule host container: virtlogd and libvirtd of its own, then the capsule agent.
# Environment: CAPSULE_HOME (the store, a volume), CAPSULE_LISTEN (HOST:PORT of the agent).
# Off unless set, for libvirt's own migration between hosts (bench/livemigrate.py):
#   CAPSULE_LIBVIRT_TCP=127.0.0.1:PORT  libvirtd also listens on this loopback port, without
#       authentication (anyone on this machine can then drive this host's libvirt: a bench only);
#       refused for any address but 127.0.0.1
#   CAPSULE_MIGRATION_PORTS=MIN-MAX  QEMU's incoming migration and NBD ports on this host
#       (hosts share the machine's network stack: give each host its own range)
set -euo pipefail

home=${CAPSULE_HOME:-/var/lib/capsule}
listen=${CAPSULE_LISTEN:-127.0.0.1:7070}
mkdir -p "$home"
log() { printf '[%s] %s\n' "$(hostname)" "$*" >&2; }

# libvirt's host identity: its own per host (otherwise every container reports the
# machine's SMBIOS UUID), kept in the store volume so it survives a new container.
[ -s "$home/host-uuid" ] || cat /proc/sys/kernel/random/uuid > "$home/host-uuid"
sed -i '/^host_uuid *=/d' /etc/libvirt/libvirtd.conf
echo "host_uuid = \"$(cat "$home/host-uuid")\"" >> /etc/libvirt/libvirtd.conf
# The container's cgroup file system is read-only (no privileged mode): libvirt puts no
# guest in cgroups of its own; the container's cgroup bounds all of this host's guests.
grep -q '^cgroup_controllers' /etc/libvirt/qemu.conf || echo 'cgroup_controllers = [ ]' >> /etc/libvirt/qemu.conf
# No libvirt network is started: all hosts share the machine's network stack, and a
# libvirt bridge would put a private-range address on it.
rm -f /etc/libvirt/qemu/networks/autostart/*.xml
# A new container starts with nothing running: pid files of the last one are stale.
rm -f /run/libvirtd.pid /run/virtlogd.pid

sed -i '/^migration_port_m\(in\|ax\) *=/d' /etc/libvirt/qemu.conf
if [ -n "${CAPSULE_MIGRATION_PORTS:-}" ]; then
  if ! [[ $CAPSULE_MIGRATION_PORTS =~ ^([0-9]+)-([0-9]+)$ ]]; then
    log "CAPSULE_MIGRATION_PORTS must be MIN-MAX, not '$CAPSULE_MIGRATION_PORTS'"
    exit 1
  fi
  printf 'migration_port_min = %s\nmigration_port_max = %s\n' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" \
    >> /etc/libvirt/qemu.conf
fi
sed -i '/^\(listen_tcp\|listen_tls\|listen_addr\|tcp_port\|auth_tcp\) *=/d' /etc/libvirt/libvirtd.conf
libvirtd_args=(-d)
if [ -n "${CAPSULE_LIBVIRT_TCP:-}" ]; then
  if ! [[ $CAPSULE_LIBVIRT_TCP =~ ^127\.0\.0\.1:([0-9]+)$ ]]; then
    log "CAPSULE_LIBVIRT_TCP must be 127.0.0.1:PORT (no authentication: loopback only), not '$CAPSULE_LIBVIRT_TCP'"
    exit 1
  fi
  printf 'listen_tcp = 1\nlisten_tls = 0\nlisten_addr = "127.0.0.1"\ntcp_port = "%s"\nauth_tcp = "none"\n' \
    "${BASH_REMATCH[1]}" >> /etc/libvirt/libvirtd.conf
  libvirtd_args+=(--listen)
  log "libvirtd also on qemu+tcp://$CAPSULE_LIBVIRT_TCP/system, without authentication"
fi

virtlogd -d
libvirtd "${libvirtd_args[@]}"
deadline=$((SECONDS + 30))
until virsh -c qemu:///system version >/dev/null 2>&1; do
  if [ $SECONDS -ge $deadline ]; then
    log "libvirtd did not answer within 30 s"
    exit 1
  fi
  sleep 0.2
done
# The agent runs as the unprivileged user capsule (scripts/setup-host.sh made it, in groups libvirt and
# libvirt-qemu), which owns the store; a store volume made by an older image (root's) is given to it once.
if [ -n "$(find "$home" -maxdepth 1 ! -user capsule -print -quit)" ]; then
  log "giving the store $home to the user capsule"
  chown -R capsule: "$home"
fi
log "libvirtd up (host uuid $(cat "$home/host-uuid")); agent on $listen as the user capsule"
# On a loopback address (the hosts share the machine's loopback; the test tier talks to them over
# http://127.0.0.1) the agent speaks plain HTTP, which capsule serve allows there only. On any other
# address, or with CAPSULE_TLS=1, it serves TLS with the host key kept in the store volume (its
# fingerprint is in the container's log: pin it with `capsule host add`).
case "${listen%:*}" in
  127.*|localhost|"[::1]") loopback=1 ;;
  *) loopback=0 ;;
esac
if [ "$loopback" = 1 ] && [ "${CAPSULE_TLS:-0}" != 1 ]; then
  exec capsule --home "$home" serve --user capsule --listen "$listen" --insecure-http
fi
exec capsule --home "$home" serve --user capsule --listen "$listen"
