#!/usr/bin/env bash
# Build the four FlowPrefill images (operator, gateway, prefill, decode) from images/ with
# buildah, as <registry>/<name>:<tag>, optionally push them, then smoke-run them
# (scripts/smoke_images.py) and print the helm line that installs the chart with them.
# No public images are published: build them here and push them to your registry.
#
#   scripts/build_images.sh [--registry REG] [--tag TAG] [--push [--authfile FILE]]
#                           [--stand-ins] [--only operator,gateway,...] [--no-smoke]
#                           [--rebuild-bases] [--from-git REV]
#
#   --registry REG  images are REG/operator, REG/gateway, REG/prefill, REG/decode
#                   (default localhost/flowprefill: local only)
#   --tag TAG       tag of all four (default: $TAG, else dev)
#   --push          buildah push each built image to REG (after its smoke run passed).
#                   Credentials: `buildah login REG` beforehand (its auth file), or
#                   --authfile FILE / REGISTRY_AUTH_FILE (a Docker config.json works), or
#                   REGISTRY_CREDS=user:password in the environment
#   --stand-ins     bases built on this machine instead of pulled (no registry reachable):
#                   Debian bookworm with Python 3.11, a Python 3.12 base for decode, and
#                   the CPU torch wheel from WHEELS (docs/images.md); never with --push
#   --only LIST     a subset, e.g. --only operator,gateway
#   --no-smoke      build only
#   --rebuild-bases rebuild the stand-in bases even if they exist
#   --from-git REV  build from a `git archive` of REV, not the working tree
#
# Environment: TAG, MIRROR (Debian mirror for debootstrap, default http://deb.debian.org/debian),
# PY312 (the CPython 3.12 installation copied into the decode stand-in, default pyenv's 3.12),
# WHEELS (wheel directory mounted into stand-in pip builds, default /opt/wheels: the CPU
# torch wheel), CA_BUNDLE (CA certificates pip trusts in stand-in builds, default the
# host's), STORAGE_DRIVER (default overlay; vfs where the kernel refuses overlay mounts),
# SUMMARY (default /var/tmp/flowprefill-images/summary.tsv), PYTHON (runs the smoke
# script; default the repository's .venv, which has flowprefill installed).
# Needs root (debootstrap and the smoke run's mounts) and: buildah crun (debootstrap for
# --stand-ins).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${TAG:-dev}
REGISTRY=localhost/flowprefill
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
SUMMARY=${SUMMARY:-/var/tmp/flowprefill-images/summary.tsv}
export STORAGE_DRIVER=${STORAGE_DRIVER:-overlay}

# Stand-in bases: local names only, never pushed.
DEBIAN_BASE=localhost/flowprefill/debian-python:bookworm
PY312_BASE=localhost/flowprefill/python:3.12-bookworm
DECODE_BASE=localhost/flowprefill/vllm-env:0.32.0-py3.12
TORCH_BASE=localhost/flowprefill/vllm-cpu:0.32.0
# What the Debian stand-in holds beyond debootstrap's minbase (Debian bookworm packages).
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
# The shared libraries CPython 3.12's extension modules link (ldd of pyenv's build; no Tk).
PY312_PACKAGES=ca-certificates,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libncursesw6,libreadline8,libexpat1,libuuid1
PY312=${PY312:-$(pyenv root 2>/dev/null || echo /root/.pyenv)/versions/3.12.1}
ALL=(operator gateway prefill decode)

ONLY=("${ALL[@]}")
SMOKE=1
PUSH=0
STAND_INS=0
AUTHFILE=${REGISTRY_AUTH_FILE:-}
REBUILD_BASES=0
FROM_GIT=
value() {  # option value: the value, or exit 2 naming the option
    [ -n "${2:-}" ] && [ "${2#--}" = "$2" ] || { echo "build_images.sh: $1 needs a value (see --help)" >&2; exit 2; }
    printf '%s' "$2"
}
while [ $# -gt 0 ]; do
    case $1 in
        --registry) REGISTRY=$(value "$1" "${2:-}"); REGISTRY=${REGISTRY%/}; shift 2 ;;
        --tag) TAG=$(value "$1" "${2:-}"); shift 2 ;;
        --push) PUSH=1; shift ;;
        --authfile) AUTHFILE=$(value "$1" "${2:-}"); shift 2 ;;
        --stand-ins) STAND_INS=1; shift ;;
        --only) list=$(value "$1" "${2:-}"); IFS=, read -r -a ONLY <<<"$list"; shift 2 ;;
        --no-smoke) SMOKE=0; shift ;;
        --rebuild-bases) REBUILD_BASES=1; shift ;;
        --from-git) FROM_GIT=$(value "$1" "${2:-}"); shift 2 ;;
        -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_images.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
for name in "${ONLY[@]}"; do
    case " ${ALL[*]} " in *" $name "*) ;; *)
        echo "build_images.sh: no image '$name' (images: ${ALL[*]})" >&2; exit 2 ;;
    esac
done
# A stand-in build is not what a GPU cluster should run (CPU torch, no vLLM in decode).
if [ "$PUSH" = 1 ] && [ "$STAND_INS" = 1 ]; then
    echo "build_images.sh: --push with --stand-ins refused: stand-in images are for this machine's checks only" >&2
    exit 2
fi
case $REGISTRY in
    localhost/*|localhost) [ "$PUSH" = 0 ] || { echo "build_images.sh: --push needs --registry (not localhost)" >&2; exit 2; } ;;
esac

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
need buildah; need crun; need python3
if [ "$STAND_INS" = 1 ]; then
    need debootstrap
    [ -d "$WHEELS" ] || { echo "build_images.sh: WHEELS=$WHEELS is not a directory" >&2; exit 1; }
    [ -f "$CA_BUNDLE" ] || { echo "build_images.sh: CA_BUNDLE=$CA_BUNDLE is not a file" >&2; exit 1; }
fi
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

debootstrap_base() {  # image packages: a Debian bookworm minbase container, left mounted
    local ctr mnt
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    debootstrap --variant=minbase --include="$2" bookworm "$mnt" "$MIRROR" >&2
    rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/cache/apt/*.bin "$mnt"/var/lib/apt/lists/*
    printf '%s %s\n' "$ctr" "$mnt"
}

debian_base() {
    step "stand-in base $DEBIAN_BASE: debootstrap bookworm minbase + $BASE_PACKAGES"
    local start=$SECONDS ctr mnt
    read -r ctr mnt < <(debootstrap_base "$DEBIAN_BASE" "$BASE_PACKAGES")
    [ -n "$mnt" ] || { echo "build_images.sh: debootstrap failed" >&2; exit 1; }
    buildah umount "$ctr" >/dev/null
    buildah config --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet --rm "$ctr" "$DEBIAN_BASE" >/dev/null
    record "$DEBIAN_BASE" $((SECONDS - start))
}

# vLLM's image (vllm/vllm-openai) runs CPython 3.12 and installs into that system Python;
# Debian bookworm has only 3.11 (trixie: 3.13). So the stand-in copies a CPython 3.12 build
# (pyenv's, built on this Debian 12 machine against bookworm's libraries) into /usr/local
# of a bookworm minbase with the libraries its modules link, as the python:3.12 images lay
# it out. The pyenv build's own files that name its prefix (scripts' shebangs, -config
# scripts) and what a runtime does not need (tests, Tk, IDLE) are left out.
py312_base() {
    step "stand-in base $PY312_BASE: debootstrap bookworm minbase + CPython 3.12 from $PY312"
    local start=$SECONDS ctr mnt
    [ -x "$PY312/bin/python3.12" ] || { echo "build_images.sh: no CPython 3.12 at PY312=$PY312" >&2; exit 1; }
    read -r ctr mnt < <(debootstrap_base "$PY312_BASE" "$PY312_PACKAGES")
    [ -n "$mnt" ] || { echo "build_images.sh: debootstrap failed" >&2; exit 1; }
    tar -C "$PY312" -c \
        --exclude='./lib/python3.12/test' --exclude='./lib/python3.12/idlelib' \
        --exclude='./lib/python3.12/tkinter' --exclude='./lib/python3.12/turtledemo' \
        --exclude='./lib/python3.12/lib-dynload/_tkinter*' --exclude='./lib/python3.12/config-3.12-*' \
        --exclude='./lib/python3.12/site-packages/*' --exclude='./lib/pkgconfig' \
        --exclude='./include' --exclude='./share' --exclude='./bin/*' \
        --exclude='*.a' \
        ./lib ./bin | tar -C "$mnt/usr/local" -x
    cp -a "$PY312/bin/python3.12" "$mnt/usr/local/bin/"
    ln -s python3.12 "$mnt/usr/local/bin/python3"
    ln -s python3 "$mnt/usr/local/bin/python"
    chroot "$mnt" /sbin/ldconfig
    # pip, as the upstream Python images have it (from the interpreter's own ensurepip).
    chroot "$mnt" /usr/local/bin/python3 -m ensurepip --default-pip >/dev/null
    chroot "$mnt" /usr/local/bin/python3 -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, readline, sys; print("stand-in python", sys.version.split()[0], ssl.OPENSSL_VERSION)'
    buildah umount "$ctr" >/dev/null
    buildah config --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet --rm "$ctr" "$PY312_BASE" >/dev/null
    record "$PY312_BASE" $((SECONDS - start))
}

# Common flags of stand-in builds: chroot isolation (no runtime needed), nothing pulled, one
# commit per stage, the wheel directory read-only at /wheels (pip --find-links inside the
# Containerfiles), and the host's CA bundle with a pip.conf naming it (a TLS-intercepting
# proxy's CA, as in this sandbox, is in the host's bundle only; pip otherwise trusts its
# own). Build-time mounts only: nothing of them stays in the images. Real-base builds pull
# the bases the Dockerfiles name and use no mounts.
bud() {  # image containerfile [build args...]
    local image=$1 file=$2
    shift 2
    if [ "$STAND_INS" = 1 ]; then
        buildah bud --isolation chroot --pull=never --layers=false \
            --volume "$WHEELS:/wheels:ro" --build-arg WHEELS_DIR=/wheels \
            --volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
            --volume "$PIP_CONF:/etc/pip.conf:ro" \
            -f "$CONTEXT/$file" -t "$image" "$@" "$CONTEXT"
    else
        buildah bud --isolation chroot --pull=missing --layers=false \
            ${AUTHFILE:+--authfile "$AUTHFILE"} -f "$CONTEXT/$file" -t "$image" "$@" "$CONTEXT"
    fi
}

stand_in() {  # image containerfile base
    step "stand-in base $1 from $2"
    local start=$SECONDS
    bud "$1" "$2" --build-arg BASE="$3"
    record "$1" $((SECONDS - start))
}

if [ "$STAND_INS" = 1 ]; then
    if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$DEBIAN_BASE"; then debian_base; fi
    case " ${ONLY[*]} " in *" decode "*)
        if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$PY312_BASE"; then py312_base; fi
        if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$DECODE_BASE"; then
            stand_in "$DECODE_BASE" images/stand-ins/vllm-env-py312/Containerfile "$PY312_BASE"
        fi
        if [ "$REBUILD_BASES" = 1 ] || ! image_exists "$TORCH_BASE"; then
            stand_in "$TORCH_BASE" images/stand-ins/vllm-cpu/Containerfile "$DEBIAN_BASE"
        fi ;;
    esac
fi

BUILT=()
for name in "${ONLY[@]}"; do
    image=$REGISTRY/$name:$TAG
    step "image $image from images/$name/Dockerfile"
    start=$SECONDS
    if [ "$STAND_INS" = 1 ]; then
        case $name in
            decode) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$DECODE_BASE" ;;
            # The PyTorch index is unreachable here: the default index (PyPI) stands in for
            # it and the CPU torch wheel comes from /wheels (2.13.0+cpu outranks PyPI's 2.13.0).
            prefill) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$DEBIAN_BASE" \
                --build-arg TORCH_INDEX_URL=https://pypi.org/simple ;;
            gateway|operator) bud "$image" "images/$name/Dockerfile" --build-arg BASE="$DEBIAN_BASE" ;;
        esac
    else
        bud "$image" "images/$name/Dockerfile"
    fi
    record "$image" $((SECONDS - start))
    BUILT+=("$name")
    if [ "$name" = decode ] && [ "$STAND_INS" = 1 ]; then
        # The 3.12 stand-in has no torch (no CPU torch for CPython 3.12 can be had here):
        # the KV connector's import under vLLM is checked on the same Dockerfile built on
        # the CPU vLLM stand-in (Python 3.11). Local only, never pushed.
        image=localhost/flowprefill/decode-vllm-cpu:$TAG
        step "image $image from images/$name/Dockerfile on $TORCH_BASE (the connector's import)"
        start=$SECONDS
        bud "$image" "images/$name/Dockerfile" --build-arg BASE="$TORCH_BASE"
        record "$image" $((SECONDS - start))
    fi
done

step "removing dangling images (build stages)"
# Not fatal: an image still used by a working container (another build) stays.
buildah images --quiet --filter dangling=true | xargs -r buildah rmi >/dev/null \
    || echo "build_images.sh: warning: some dangling images are in use and were kept" >&2

if [ "$SMOKE" = 1 ]; then
    step "smoke runs: ${ONLY[*]}"
    # The smoke run writes the images' config files with flowprefill.contracts: the venv's python.
    PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
    "$PYTHON" "$ROOT/scripts/smoke_images.py" --registry "$REGISTRY" --tag "$TAG" "${ONLY[@]}"
fi

if [ "$PUSH" = 1 ]; then
    for name in "${BUILT[@]}"; do
        image=$REGISTRY/$name:$TAG
        step "push $image"
        buildah push ${AUTHFILE:+--authfile "$AUTHFILE"} ${REGISTRY_CREDS:+--creds "$REGISTRY_CREDS"} \
            "$image" "docker://$image"
    done
fi

step "done; sizes and build times in $SUMMARY"
column -t -s $'\t' "$SUMMARY"
echo
if [ "$PUSH" = 1 ]; then
    echo "Install the chart with these images:"
else
    echo "After pushing them to a registry the cluster can pull from (--push, or buildah push), install the chart with:"
fi
echo "  helm install flowprefill charts/flowprefill --namespace flowprefill-system --create-namespace --set image.registry=$REGISTRY --set image.tag=$TAG"
