#!/bin/sh
# The install steps every stage image shares, run by its Dockerfile in two layers so a code change rebuilds
# seconds of work, not the whole stack:
#
#   install.sh stack STAGE STACK     the pinned stack (cached until the lock file or the base image changes):
#     1. the virtual environment /opt/loupe, seeing the base image's own packages (a GPU base's torch and vLLM
#        are reused, not reinstalled);
#     2. requirements.STACK.lock, hash-checked and with --no-deps (a lock is complete: containers/locks.py
#        check walks its closure), from /wheelhouse/STACK when the build mounts wheels there (offline builds;
#        containers/build.sh fills containers/wheelhouse/), else from the package index;
#     3. on the gpu stack, source-builds.txt (source-only packages such as flash-attn), built with
#        --no-build-isolation against the image's torch;
#     4. the non-root user `loupe` (uid 10001, clashing with no base image's users).
#   install.sh project STAGE         the project's code, copied to /opt/loupe-build/src, installed, removed;
#     where the lock holds RapidOCR (the images that run rollouts), OpenCV and RapidOCR's models are loaded once.
#
# The lock, source-builds.txt and this script are copied to /opt/loupe-build/ first; wheels are mounted, never
# copied into a layer, so one image stage leaves nothing behind that a multi-stage build would have to drop.
set -eu
phase="$1"
stage="$2"
build=/opt/loupe-build
pip="/opt/loupe/bin/python -m pip --no-cache-dir --disable-pip-version-check"

case "$phase" in
stack)
    stack="$3"
    lock="$build/requirements.$stack.lock"
    [ -f "$lock" ] || { echo "install: no lock file $lock (stacks: cpu, gpu)" >&2; exit 2; }
    python3 -m venv --system-site-packages /opt/loupe
    if ls "/wheelhouse/$stack"/*.whl > /dev/null 2>&1; then
        echo "install: $stage's $stack stack offline, from /wheelhouse/$stack"
        index="--no-index --find-links /wheelhouse/$stack"
    else
        echo "install: $stage's $stack stack from the package index"
        index=""
    fi
    # The lock's setuptools first: the lock's few sdists (LLaMA-Factory's antlr4) build with --no-build-isolation
    # offline, and the venv's bundled setuptools may be too old to build wheels on its own.
    grep -A1 '^setuptools==' "$lock" > /tmp/build-tools.txt
    # shellcheck disable=SC2086  # $pip and $index are word lists
    $pip install $index --require-hashes --no-deps -r /tmp/build-tools.txt
    # shellcheck disable=SC2086
    $pip install $index --require-hashes --no-deps --no-build-isolation -r "$lock"
    if [ "$stack" = gpu ] && [ -f "$build/source-builds.txt" ]; then
        # shellcheck disable=SC2086
        $pip install --no-build-isolation --require-hashes --no-deps -r "$build/source-builds.txt"
    fi
    useradd --no-log-init --create-home --uid 10001 --user-group --shell /bin/sh loupe
    ;;
project)
    # shellcheck disable=SC2086
    $pip install --no-index --no-deps --no-build-isolation "$build/src"
    if grep -qs '^rapidocr-onnxruntime==' "$build"/requirements.*.lock; then
        # An image that runs rollouts holds the visual operations (base/visual-ops.in): OpenCV imported and
        # RapidOCR's models loaded once, so a library the base lacks fails the build, not the first read_text.
        (cd / && /opt/loupe/bin/python -c "import cv2, loupe.visual_ops as ops; ops.ocr_engine(); print('install: OpenCV', cv2.__version__, 'and RapidOCR load')")
    fi
    rm -rf "$build"
    (cd / && /opt/loupe/bin/python -c "import loupe, stages.$stage; print('install: loupe', loupe.__version__)")
    ;;
*)
    echo "install: unknown phase '$phase' (stack | project)" >&2
    exit 2
    ;;
esac
