#!/usr/bin/env bash
# A Docker daemon for `make image` / `make test-deploy`: `start` installs Debian's docker.io when no
# daemon binary exists (needs root) and starts one when none answers; `stop` stops only a daemon that
# `start` started (a marker in $STATE says so), so a daemon you run yourself is left alone.
set -euo pipefail
STATE=${SCD_DEPLOY_STATE:-${SCD_HOME:-$HOME/.cache/scd}/deploy}
mkdir -p "$STATE"
# the image build peaks at ~5 GB in the daemon's data root (the build stage, pruned after), the
# deploy tests at ~3 GB (the image and one models volume): a full disk fails deep inside a test
free_space() {
  local root gb
  root=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null | tr -d '\n') || true
  root=${root:-/var/lib/docker}
  while [ ! -d "$root" ] && [ "$root" != / ]; do root=$(dirname "$root"); done
  gb=$(df -Pk "$root" 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
  if [ -n "$gb" ] && [ "$gb" -lt 6 ]; then
    echo "warning: $gb GB free under $root; make image and make test-deploy need about 6 GB" >&2
  fi
}
case "${1:-}" in
  start)
    if docker info >/dev/null 2>&1; then echo "docker daemon: already running"; free_space; exit 0; fi
    if ! command -v dockerd >/dev/null; then
      echo "docker daemon: installing Debian's docker.io (apt-get)"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -q >/dev/null && apt-get install -y -q docker.io >/dev/null
    fi
    command -v docker >/dev/null || { echo "no docker client after installing docker.io" >&2; exit 1; }
    nohup dockerd --pidfile "$STATE/dockerd.pid" >"$STATE/dockerd.log" 2>&1 &
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start; see $STATE/dockerd.log" >&2; tail -n 20 "$STATE/dockerd.log" >&2; exit 1; }
    touch "$STATE/dockerd.started"
    echo "docker daemon: started (log $STATE/dockerd.log)"
    free_space
    ;;
  stop)
    [ -f "$STATE/dockerd.started" ] || { echo "docker daemon: not started by us, left running"; exit 0; }
    pid=$(cat "$STATE/dockerd.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "$STATE/dockerd.started"
    echo "docker daemon: stopped"
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
