#!/usr/bin/env bash
# The image's base, made locally (no registry is reachable): a minimal Debian bookworm root with its
# Python 3.11, from debootstrap (Debian's mirror), imported into Docker. Skipped when the tag exists.
set -euo pipefail
TAG=${1:-scd-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then echo "base image $TAG: present"; exit 0; fi
if ! command -v debootstrap >/dev/null; then
  echo "base image: installing debootstrap (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base image $TAG: debootstrap bookworm from $MIRROR (about a minute)"
debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-distutils,python3-lib2to3,ca-certificates,passwd \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "base image $TAG: imported ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
