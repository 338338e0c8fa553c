#!/usr/bin/env bash
# Make the local stand-in for python:3.11-slim when no registry can be reached: a minimal Debian bookworm
# (debootstrap --variant=minbase) with Debian's Python 3.11 and venv, imported into podman as one layer.
#   containers/base/bootstrap.sh [IMAGE]          default IMAGE: localhost/loupe-python:3.11-bookworm
# Needs root, debootstrap and podman (containers/setup-host.sh) and a Debian mirror (DEBIAN_MIRROR).
# About 45 s; the root file system is rebuilt from scratch each time and removed afterwards.
set -euo pipefail
image="${1:-localhost/loupe-python:3.11-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
here="$(cd "$(dirname "$0")/.." && pwd)"
rootfs="$here/.build/rootfs"

rm -rf "$rootfs"
mkdir -p "$rootfs"
trap 'rm -rf "$rootfs"' EXIT
echo "bootstrap: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
    > "$here/.build/debootstrap.log" 2>&1 || { tail -20 "$here/.build/debootstrap.log"; exit 1; }
# What a base image does not need: package caches, lists, documentation (165 MB left of 275).
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
tar -C "$rootfs" --numeric-owner -c . | "${CONTAINER_ENGINE:-podman}" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase bookworm + python3, python3-venv" \
    - "$image" > /dev/null
echo "bootstrap: $image ($("${CONTAINER_ENGINE:-podman}" run --rm "$image" python3 --version))"
