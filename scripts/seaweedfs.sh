#!/usr/bin/env bash
# Build SeaweedFS's `weed` binary (Apache-2.0: master, volume servers, filer and S3 gateway in one
# binary) from the Go module proxy at a pinned version, once, into a cache outside the clone keyed by
# version: /var/cache/capsule/seaweedfs/VERSION/weed as root, else ~/.cache/capsule/seaweedfs/VERSION/weed.
# The capsule repository's tools-tier tests and `capsule repo` users run it as their object store.
#
# `go install MODULE/weed@VERSION` is refused (the module's go.mod has replace directives), so the module
# is downloaded, its source copied to a writable directory and built there. The module and build caches
# are private to the build and removed afterwards (they are ~3.4 GB). Prints the binary's path.
#   scripts/seaweedfs.sh            build if missing, print the path
#   scripts/seaweedfs.sh --path     print the path only (exit 1 if not built)
set -euo pipefail

VERSION="${CAPSULE_SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"
MODULE=github.com/seaweedfs/seaweedfs
if [ -n "${CAPSULE_SEAWEEDFS_CACHE:-}" ]; then
  CACHE="$CAPSULE_SEAWEEDFS_CACHE"
elif [ "$(id -u)" = 0 ]; then
  CACHE=/var/cache/capsule/seaweedfs
else
  CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/capsule/seaweedfs"
fi
OUT="$CACHE/$VERSION/weed"

if [ "${1:-}" = "--path" ]; then
  [ -x "$OUT" ] && { echo "$OUT"; exit 0; }
  exit 1
fi
if [ -x "$OUT" ]; then
  echo "$OUT"
  exit 0
fi
command -v go >/dev/null || { echo "seaweedfs: go is not installed (apt-get install golang-go, or Go from go.dev)" >&2; exit 1; }

mkdir -p "$CACHE/$VERSION"
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null || true; rm -rf "$WORK"' EXIT
export GOMODCACHE="$WORK/mod" GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath" GOFLAGS="${GOFLAGS:--buildvcs=false}"
echo "seaweedfs: downloading $MODULE@$VERSION" >&2
DIR="$(go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
[ -d "$DIR" ] || { echo "seaweedfs: go mod download gave no source directory" >&2; exit 1; }
cp -r "$DIR" "$WORK/src"
chmod -R u+w "$WORK/src"
echo "seaweedfs: building weed (several minutes)" >&2
(cd "$WORK/src" && go build -trimpath -ldflags "-s -w" -o "$WORK/weed" ./weed)
mv "$WORK/weed" "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
