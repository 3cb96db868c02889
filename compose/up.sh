#!/usr/bin/env bash
# `make compose-up`: build the base image if missing, build the host image (cached
# layers), start the hosts, and wait until every agent answers /v1/info with its token.
# Usage: compose/up.sh [SERVICE...]   (default: every service in docker-compose.yml)
# Environment: CAPSULE_COMPOSE_TIMEOUT (seconds to wait for the agents, default 120).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's docker client and compose, not another `docker` earlier on PATH
export PATH=/usr/bin:/usr/sbin:$PATH
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-capsule}
files=(-f docker-compose.yml)
[ -e /dev/kvm ] && files+=(-f docker-compose.kvm.yml)
[ -e /dev/userfaultfd ] && files+=(-f docker-compose.uffd.yml)
log() { printf '\033[1;34m[compose]\033[0m %s\n' "$*" >&2; }

if ! docker info >/dev/null 2>&1; then
  echo "docker does not answer: run \`make setup\` (installs docker.io and starts dockerd)" >&2
  exit 1
fi
t0=$SECONDS
# the host image installs the compiled extension's wheel that `make native` leaves in native/dist
if ! compgen -G "native/dist/capsule_native-*.whl" >/dev/null; then
  log "building the compiled extension (native/)"
  bash scripts/build-native.sh "${PYTHON:-.venv/bin/python}"
fi
bash compose/base.sh
# the object store's `weed` binary (make setup builds it; built here if missing), mounted into its service
weed=$(bash scripts/seaweedfs.sh | tail -n 1)
export CAPSULE_WEED_DIR="${weed%/weed}"
t1=$SECONDS
log "building the host image"
docker-compose "${files[@]}" build "$@" >&2
t2=$SECONDS
docker-compose "${files[@]}" up -d "$@" >&2

# the agent's answer to GET /v1/info over loopback (bash's /dev/tcp: no client needed)
info_status() {  # PORT TOKEN
  local status
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET /v1/info HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n\r\n' "$2" >&3
  read -r -t 5 _ status _ <&3 || status=""
  exec 3<&-
  [ "$status" = 200 ]
}

services=("$@")
[ ${#services[@]} -gt 0 ] || mapfile -t services < <(docker-compose "${files[@]}" config --services)
deadline=$((SECONDS + ${CAPSULE_COMPOSE_TIMEOUT:-120}))
for svc in "${services[@]}"; do
  cid=$(docker-compose "${files[@]}" ps -q "$svc")
  if [ "$svc" = object-store ]; then     # no agent: ready once its S3 gateway stored and returned an object
    until docker exec "$cid" test -e /var/lib/seaweedfs/ready 2>/dev/null; do
      if [ "$(docker inspect -f '{{.State.Running}}' "$cid" 2>/dev/null)" != true ] || [ $SECONDS -ge $deadline ]; then
        log "$svc did not become ready; its log:"
        docker logs --tail 50 "$cid" >&2 || true
        exit 1
      fi
      sleep 0.5
    done
    log "$svc answers on S3 http://127.0.0.1:${CAPSULE_S3_PORT:-7180}"
    continue
  fi
  until
    listen=$(docker exec "$cid" printenv CAPSULE_LISTEN 2>/dev/null) &&
    token=$(docker exec "$cid" sh -c 'cat "$CAPSULE_HOME/agent.token"' 2>/dev/null) &&
    info_status "${listen##*:}" "$token" 2>/dev/null
  do
    if [ "$(docker inspect -f '{{.State.Running}}' "$cid" 2>/dev/null)" != true ] || [ $SECONDS -ge $deadline ]; then
      log "$svc did not answer on /v1/info; its log:"
      docker logs --tail 50 "$cid" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  log "$svc answers on http://$listen"
done
log "up in $((SECONDS - t0)) s (base image $((t1 - t0)) s, host image $((t2 - t1)) s, start $((SECONDS - t2)) s)"
