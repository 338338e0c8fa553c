#!/usr/bin/env bash
# Build Loupe's stage images with podman (or docker), offline: wheels are fetched on the host first.
#
#   containers/build.sh [--gpu] [STAGE...]        STAGE: synth sft rl eval (default: all four)
#
# CPU (default, what builds on a machine without GPUs or a registry): every image is built on the
# locally bootstrapped stand-in for python:3.11-slim (containers/base/bootstrap.sh, made when missing), from
# its requirements.cpu.lock, with `--network none`: the wheels are downloaded into containers/wheelhouse/cpu/
# beforehand (one folder for every CPU image: they share torch). Tags: loupe-STAGE:latest and loupe-STAGE:VERSION.
# --gpu: on the stage's GPU base (LLaMA-Factory's image for sft, vLLM's for rl and eval; synth stays on
# python:3.11-slim) from requirements.gpu.lock; needs a registry and the package index. Tags :gpu, :VERSION-gpu.
#
# Environment: CONTAINER_ENGINE (podman|docker, default podman), BASE_IMAGE (overrides the base of every
# image), PYTHON (runs containers/locks.py; default .venv/bin/python), IMAGE_PREFIX (default loupe-).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

stack=cpu
stages=()
for arg in "$@"; do
    case "$arg" in
        --gpu) stack=gpu ;;
        synth|sft|rl|eval) stages+=("$arg") ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument '$arg' (stages: synth sft rl eval; option: --gpu)" >&2; exit 2 ;;
    esac
done
[ "${#stages[@]}" -gt 0 ] || stages=(synth sft rl eval)

engine="${CONTAINER_ENGINE:-podman}"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
prefix="${IMAGE_PREFIX:-loupe-}"
local_base="localhost/loupe-python:3.11-bookworm"
version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then commit="$commit-dirty"; fi
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

if [ "$engine" = podman ] && ! grep -qs 'runtime *= *"runc"' /etc/containers/containers.conf; then
    # This machine's settings (runc, ulimits) when the host has not been set up with containers/setup-host.sh.
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$root/containers/podman/containers.conf}"
fi

gpu_base() {
    case "$1" in
        sft) echo "hiyouga/llamafactory:0.9.5" ;;
        rl|eval) echo "vllm/vllm-openai:v0.32.0" ;;
        *) echo "python:3.11-slim" ;;
    esac
}

if [ "$stack" = cpu ] && [ -z "${BASE_IMAGE:-}" ] && ! "$engine" image inspect "$local_base" > /dev/null 2>&1; then
    echo "== base: $local_base missing, bootstrapping it"
    "$root/containers/base/bootstrap.sh" "$local_base"
fi

for stage in "${stages[@]}"; do
    target_stack="$stack"
    [ "$stage" = synth ] && target_stack=cpu          # synth has one stack: it runs no model
    target="$stage-$target_stack"
    if [ "$stack" = cpu ]; then base="${BASE_IMAGE:-$local_base}"; else base="${BASE_IMAGE:-$(gpu_base "$stage")}"; fi
    tag_suffix=""; [ "$stack" = gpu ] && tag_suffix="-gpu"
    image="$prefix$stage"
    tags=(--tag "$image:${stack/cpu/latest}" --tag "$image:$version$tag_suffix")
    started=$SECONDS
    network=()
    format=(); [ "$engine" = podman ] && format=(--format docker)   # OCI format drops SHELL and HEALTHCHECK
    if [ "$stack" = cpu ]; then
        echo "== $target: fetching wheels into containers/wheelhouse/cpu"
        "$python" containers/locks.py fetch "$target" --dest containers/wheelhouse/cpu > /dev/null
        network=(--network none)
    fi
    previous="$("$engine" image inspect --format '{{.Id}}' "$image:${stack/cpu/latest}" 2>/dev/null || true)"
    echo "== $target: building $image on $base"
    "$engine" build "${network[@]}" "${format[@]}" --file "containers/$stage/Dockerfile" "${tags[@]}" \
        --build-arg "BASE_IMAGE=$base" --build-arg "STACK=$target_stack" \
        --build-arg "VERSION=$version" --build-arg "COMMIT=$commit" --build-arg "CREATED=$created" .
    size="$("$engine" image inspect --format '{{.Size}}' "$image:${stack/cpu/latest}")"
    current="$("$engine" image inspect --format '{{.Id}}' "$image:${stack/cpu/latest}")"
    if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
        # The image this build replaced, now untagged (gigabytes when its stack changed); kept if still in use.
        "$engine" rmi "$previous" > /dev/null 2>&1 || true
    fi
    echo "== $target: $image:${stack/cpu/latest} built in $((SECONDS - started)) s, $((size / 1000000)) MB"
done
