#!/usr/bin/env bash
# Build the base image of a Capsule host container, without a container registry:
# mmdebstrap (minbase bookworm) → `docker import`. apt inside the image uses this
# machine's own Debian sources (bookworm, and bookworm-backports as `make setup`
# added it), passed to mmdebstrap as files: no mirror name is written anywhere.
# Usage: compose/base.sh [IMAGE]   (default capsule-base:bookworm; a no-op if it exists)
set -euo pipefail

image=${1:-capsule-base:bookworm}
docker=${DOCKER:-/usr/bin/docker}

if "$docker" image inspect "$image" >/dev/null 2>&1; then
  exit 0
fi

# apt's configured source files that name a bookworm suite (like capsule/imagebuild/debian.py)
eval "$(apt-config shell SL Dir::Etc::sourcelist/f SP Dir::Etc::sourceparts/d)"
sources=()
for f in "${SL:-}" "${SP:-/etc/apt/sources.list.d}"/*.list "${SP:-/etc/apt/sources.list.d}"/*.sources; do
  [ -f "$f" ] || continue
  grep -qiE '^\s*Enabled:\s*no' "$f" && continue
  grep -vE '^\s*#' "$f" | grep -q 'bookworm' && sources+=("$f")
done
if [ ${#sources[@]} -eq 0 ]; then
  echo "no apt source for Debian bookworm on this machine" >&2
  exit 1
fi
if ! cat "${sources[@]}" | grep -vE '^\s*#' | grep -q 'bookworm-backports'; then
  echo "no bookworm-backports apt source on this machine: run \`make setup\` first" >&2
  exit 1
fi

echo "[compose] building $image with mmdebstrap from ${#sources[@]} apt source file(s)" >&2
start=$(date +%s)
# ca-certificates: pip reaches PyPI over TLS in the image build, trusting what this machine
# trusts (its CA bundle may hold a local CA, e.g. of a TLS-inspecting proxy)
mmdebstrap --quiet --variant=minbase --include=ca-certificates \
  --aptopt='Acquire::Languages "none"' \
  --customize-hook='cat /etc/ssl/certs/ca-certificates.crt > "$1/usr/local/share/ca-certificates/build-machine.crt"' \
  --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm - "${sources[@]}" | "$docker" import - "$image" >/dev/null
echo "[compose] $image built in $(( $(date +%s) - start )) s" >&2
