#!/usr/bin/env bash
# Install everything Capsule needs on a Debian bookworm host (run as root).
# Idempotent: a second run only checks and skips.
# `setup-host.sh --image` does the same inside a Capsule host image build, without
# starting daemons or installing docker.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
stamp_dir="$here/.setup"
mkdir -p "$stamp_dir"
log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "setup-host.sh must run as root (it installs Debian packages and starts libvirtd)" >&2
    exit 1
  fi
}

# --- apt sources: bookworm-backports, reusing the machine's own Debian URI ---
add_backports() {
  if grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null; then
    return
  fi
  local uri=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # deb822: first URIs: of a stanza whose Suites: contains plain "bookworm"
    uri=$(awk '
      /^URIs:/ {u=$2}
      /^Suites:/ { for (i=2;i<=NF;i++) if ($i=="bookworm") {print u; exit} }
      /^$/ {u=""}' "$f")
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ]; then
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] || continue
      uri=$(awk '$1=="deb" && $3=="bookworm" {print $2; exit}' "$f")
      [ -n "$uri" ] && break
    done
  fi
  if [ -z "$uri" ]; then
    echo "cannot find a Debian bookworm apt source to derive bookworm-backports from" >&2
    exit 1
  fi
  log "adding bookworm-backports (from $uri)"
  cat > /etc/apt/sources.list.d/capsule-backports.sources <<EOT
Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOT
  rm -f "$stamp_dir/apt-updated"
}

pkg_ok() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

install_packages() {
  local base=(mmdebstrap zstd e2fsprogs busybox-static cpio python3-venv python3-dev libc6-dev
              pkg-config gcc make iproute2 rsync socat dnsmasq-base
              ovmf kmod ca-certificates)
  local bpo=(qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-daemon libvirt-clients
             libvirt-dev nbdkit nbdkit-plugin-python nbdkit-plugin-dev)
  local missing_base=() missing_bpo=()
  for p in "${base[@]}"; do pkg_ok "$p" || missing_base+=("$p"); done
  for p in "${bpo[@]}"; do pkg_ok "$p" || missing_bpo+=("$p"); done
  if [ "$image" != 1 ]; then
    # the browser tests' chromium, and npm for the page's browser libraries (web/package-lock.json:
    # `make web`; any node >= 18 will do); a Capsule host image (--image) needs neither
    pkg_ok chromium || missing_base+=(chromium)
    command -v npm >/dev/null || missing_base+=(nodejs npm)
    # borg: a peer in bench/backup_series.py (B4)
    pkg_ok borgbackup || missing_base+=(borgbackup)
    # restic: the peer of Capsule's S3 repository in bench/repo_vs_restic.py (B5)
    pkg_ok restic || missing_base+=(restic)
    # ostree (static deltas) and casync (content-defined chunks): peers in bench/update_bytes.py (B1)
    pkg_ok ostree || missing_base+=(ostree)
    pkg_ok casync || missing_base+=(casync)
    # libguestfs (and a kernel for its appliance): a peer in bench/backup_files.py, beside `backup files`'
    # own sandboxed e2fsprogs; Capsule itself does not use it
    pkg_ok libguestfs-tools || missing_base+=(libguestfs-tools)
    pkg_ok linux-image-amd64 || missing_base+=(linux-image-amd64)
    # clang with libFuzzer and the sanitizers: the guest agent's fuzz harness (make fuzz, guest-balloon/fuzz/)
    pkg_ok clang-14 || missing_base+=(clang-14)
    pkg_ok libclang-rt-14-dev || missing_base+=(libclang-rt-14-dev)
  fi
  # QEMU and libvirt must come from backports (QEMU >= 10, libvirt >= 11.3)
  if pkg_ok qemu-system-x86; then
    local qv; qv=$(dpkg-query -W -f='${Version}' qemu-system-x86)
    dpkg --compare-versions "$qv" ge 1:10 || missing_bpo+=(qemu-system-x86 qemu-utils)
  fi
  if pkg_ok libvirt-daemon; then
    local lv; lv=$(dpkg-query -W -f='${Version}' libvirt-daemon)
    dpkg --compare-versions "$lv" ge 11.3 || missing_bpo+=(libvirt-daemon-system libvirt-daemon libvirt-clients libvirt-dev)
  fi
  if [ ${#missing_base[@]} -eq 0 ] && [ ${#missing_bpo[@]} -eq 0 ]; then
    return
  fi
  export DEBIAN_FRONTEND=noninteractive
  if [ ! -f "$stamp_dir/apt-updated" ]; then
    log "apt-get update"
    apt-get update -q
    touch "$stamp_dir/apt-updated"
  fi
  if [ ${#missing_base[@]} -gt 0 ]; then
    log "installing ${missing_base[*]}"
    apt-get install -y -q --no-install-recommends "${missing_base[@]}"
  fi
  if [ ${#missing_bpo[@]} -gt 0 ]; then
    log "installing from bookworm-backports: ${missing_bpo[*]}"
    apt-get install -y -q --no-install-recommends -t bookworm-backports "${missing_bpo[@]}"
  fi
}

configure_libvirt() {
  # QEMU runs as libvirt's unprivileged user (libvirt-qemu): each domain's XML names it in a static DAC
  # label, and the store grants that user's group what a guest opens (capsule/runtime/guestaccess.py).
  # Hosts set up before that ran every guest as root: take that setting out again.
  local conf=/etc/libvirt/qemu.conf
  if grep -q "^# capsule: run guests as root" "$conf"; then
    log "configuring libvirt's QEMU driver (guests no longer run as root)"
    sed -i '/^# capsule: run guests as root/,/^group = "root"$/d' "$conf"
    if running_here libvirtd; then
      pkill --ns $$ --nslist mnt,pid -x libvirtd || true
      for _ in $(seq 1 50); do running_here libvirtd || break; sleep 0.1; done
    fi
  fi
  if ! id libvirt-qemu >/dev/null 2>&1; then
    log "libvirt-qemu, the user QEMU runs as, is missing: is libvirt-daemon-system installed?"
    exit 1
  fi
}

# --- libvirtd's unix socket: for the group libvirt, without polkit ---
# The agent runs as the unprivileged user capsule (`capsule serve --user capsule`) and drives the system libvirtd
# (qemu:///system). Debian's default socket is 0777 behind polkit, which needs a system bus this host may not have;
# instead the read-write socket is libvirt's group's (0770) and membership is the permission. Written before libvirtd
# starts; a libvirtd already running with another configuration is left alone (the log says to restart it).
libvirt_socket_changed=0
configure_libvirt_socket() {
  local conf=/etc/libvirt/libvirtd.conf want
  want=$'unix_sock_group = "libvirt"\nunix_sock_rw_perms = "0770"\nauth_unix_rw = "none"'
  if [ "$(grep -E '^(unix_sock_group|unix_sock_rw_perms|auth_unix_rw) *=' "$conf" 2>/dev/null)" = "$want" ]; then
    return
  fi
  log "configuring libvirtd's socket: group libvirt, 0770, no polkit (the capsule user is in group libvirt)"
  sed -i -E '/^(unix_sock_group|unix_sock_rw_perms|auth_unix_rw) *=/d; /^# capsule: libvirtd socket/d' "$conf"
  printf '# capsule: libvirtd socket for group libvirt (scripts/setup-host.sh)\n%s\n' "$want" >> "$conf"
  libvirt_socket_changed=1
}

# --- capsule-sandbox: the unprivileged user that parses guest-controlled data (capsule/sandbox.py) ---
# `backup files` runs e2fsck and debugfs on a guest's file system as this user, with no capabilities.
# It owns nothing, has no home or shell and belongs to no other group.
create_users() {
  if ! getent group capsule-sandbox >/dev/null; then
    log "creating the group capsule-sandbox"
    groupadd --system capsule-sandbox
  fi
  if ! id capsule-sandbox >/dev/null 2>&1; then
    log "creating the user capsule-sandbox (guest file systems are parsed as it)"
    useradd --system --gid capsule-sandbox --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin capsule-sandbox
  fi
  # capsule: the agent's user (`capsule serve --user capsule`), owner of the store. In libvirt (its socket) and
  # libvirt-qemu (it grants QEMU's group the files a guest opens), and kvm where that group exists.
  if ! getent group capsule >/dev/null; then
    log "creating the group capsule"
    groupadd --system capsule
  fi
  if ! id capsule >/dev/null 2>&1; then
    log "creating the user capsule (the agent runs as it: capsule serve --user capsule)"
    useradd --system --gid capsule --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin capsule
  fi
  local g
  for g in libvirt libvirt-qemu kvm; do
    if getent group "$g" >/dev/null && ! id -nG capsule | tr ' ' '\n' | grep -qx "$g"; then
      log "adding the user capsule to the group $g"
      usermod -a -G "$g" capsule
    fi
  done
}

# a daemon of this machine, not one of a compose host's containers (their processes show in our pid list)
running_here() {
  pgrep --ns $$ --nslist mnt,pid -x "$1" >/dev/null
}

start_daemons() {
  if [ "$libvirt_socket_changed" = 1 ] && running_here libvirtd; then
    log "libvirtd already runs with its old socket settings: restart it for the capsule user to reach it" \
        "(e.g. \`pkill -x libvirtd && libvirtd -d\`); it was not restarted"
  fi
  if ! running_here virtlogd; then
    log "starting virtlogd"
    setsid virtlogd -d
  fi
  if ! running_here libvirtd; then
    log "starting libvirtd"
    setsid libvirtd -d
  fi
  for _ in $(seq 1 50); do
    virsh -c qemu:///system version >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "libvirtd did not answer on qemu:///system" >&2
  exit 1
}

# --- docker: separate Capsule hosts (docker-compose.yml, the `hosts` test tier) ---
# Debian's own docker.io and docker-compose. docker's bridge stays unused: every
# Capsule host container uses the machine's network (loopback ports), so the
# daemon is told to create no bridge and no iptables rules (no private-range
# addresses appear on the machine). An existing daemon.json is left alone.
configure_docker() {
  if [ ! -e /etc/docker/daemon.json ]; then
    log "writing /etc/docker/daemon.json (no bridge, no iptables: host networking only)"
    mkdir -p /etc/docker
    printf '{\n  "bridge": "none",\n  "iptables": false,\n  "ip-forward": false\n}\n' > /etc/docker/daemon.json
  fi
  local missing=()
  pkg_ok docker.io || missing+=(docker.io)
  pkg_ok docker-compose || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if [ ! -f "$stamp_dir/apt-updated" ]; then
      apt-get update -q
      touch "$stamp_dir/apt-updated"
    fi
    log "installing ${missing[*]}"
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
}

start_dockerd() {
  # Debian's client, not whatever `docker` comes first on PATH
  if /usr/bin/docker info >/dev/null 2>&1; then
    return
  fi
  if ! pgrep -x dockerd >/dev/null; then
    log "starting dockerd (log: /var/log/capsule-dockerd.log)"
    setsid /usr/sbin/dockerd >>/var/log/capsule-dockerd.log 2>&1 < /dev/null &
  fi
  for _ in $(seq 1 150); do
    /usr/bin/docker info >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "dockerd did not answer within 30 s; see /var/log/capsule-dockerd.log" >&2
  exit 1
}

image=0
[ "${1:-}" = "--image" ] && image=1
need_root
add_backports
install_packages
configure_libvirt
configure_libvirt_socket
create_users
if [ "$image" = 1 ]; then
  # inside a Capsule host image build (compose/Dockerfile): packages and configuration only;
  # the container's entrypoint starts the daemons
  log "image ready"
  exit 0
fi
start_daemons
configure_docker
start_dockerd
log "host ready"
