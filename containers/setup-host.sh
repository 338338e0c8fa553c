#!/usr/bin/env bash
# Install what building and running Loupe's images needs on a Debian/Ubuntu host, as root:
#   podman (rootful), runc as its runtime, debootstrap for the locally bootstrapped base image,
# and podman's settings (runc, ulimits) from containers/podman/containers.conf.
# Idempotent: does nothing when podman, runc and debootstrap are already there and configured.
#   sudo containers/setup-host.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

missing=()
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup-host: installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc debootstrap
fi

conf=/etc/containers/containers.conf
if [ ! -f "$conf" ]; then
    echo "setup-host: writing $conf (runtime runc, ulimits nofile 20000 / nproc 32768)"
    install -D -m 0644 "$here/podman/containers.conf" "$conf"
elif ! grep -q 'runtime *= *"runc"' "$conf"; then
    echo "setup-host: $conf exists and does not select runc; builds use CONTAINERS_CONF=$here/podman/containers.conf" >&2
fi
podman --version
