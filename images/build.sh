#!/usr/bin/env bash
# Build kvship's images on a machine that reaches Debian's packages and a Python package index but no container
# registry: debootstrap a Debian root filesystem, `podman import` it as the local base, then `podman build
# --isolation chroot` each Dockerfile of images/ on it with BASE pointing at that base.
#
#   bash images/build.sh                       # router, operator, worker-cpu
#   bash images/build.sh router worker-cpu     # only these
#   bash images/build.sh worker-cuda-check     # the CUDA Dockerfile path on the Debian base, CPU torch
#                                              # (a structure check only: docs/operator.md, "Images")
# Environment: TAG (default 0.1.0), REPO (default localhost/kvship), BASE_IMAGE (default
# localhost/kvship-base:bookworm; built when missing), DEBIAN_MIRROR, KVSHIP_IMAGES_WORK (scratch folder),
# TORCH_INDEX_URL (the worker's torch index), PRUNE=1 (remove every dangling image afterwards: the build stages'
# cached layers), SUMMARY=FILE (append "name tag seconds bytes" per image).
# Where base images can be pulled, plain `docker build` / `podman build` of the same Dockerfiles is enough.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TAG=${TAG:-0.1.0}
REPO=${REPO:-localhost/kvship}
BASE_IMAGE=${BASE_IMAGE:-localhost/kvship-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WORK=${KVSHIP_IMAGES_WORK:-/var/tmp/kvship-images}
KNOWN="router operator worker-cpu worker-cuda-check"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(router operator worker-cpu)
for t in "${TARGETS[@]}"; do
  case " $KNOWN " in *" $t "*) ;; *) echo "build.sh: unknown image '$t' (known: $KNOWN)" >&2; exit 2 ;; esac
done

say() { printf '[build.sh %s] %s\n' "$(date +%T)" "$*" >&2; }

# ---- tools
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "build.sh: podman and debootstrap are needed (apt-get install podman debootstrap)" >&2; exit 1; }
  say "installing podman and debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman debootstrap >/dev/null
fi
[ "$(id -u)" = 0 ] || { echo "build.sh: debootstrap and chroot builds need root" >&2; exit 1; }

# ---- the local base: Debian bookworm minbase with Python (what python:3.11-slim-bookworm gives, from Debian)
if ! podman image exists "$BASE_IMAGE"; then
  mkdir -p "$WORK"
  rootfs=$(mktemp -d "$WORK/rootfs.XXXXXX")
  say "debootstrap bookworm -> $rootfs"
  t0=$(date +%s)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" >"$rootfs/etc/apt/sources.list"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  say "base $BASE_IMAGE imported in $(( $(date +%s) - t0 )) s"
fi

# ---- this machine's pip settings, handed to the build stages (mirrors, local wheels such as torch+cpu, a CA)
# Each local path they name is bind-mounted read-only at the same path for the build's RUN steps only.
BUILD_ARGS=() VOLUMES=()
pip_setting() {  # $1 = pip option name: the environment first, then pip's configuration files
  local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env:-}" ]; then echo "${!env}"; return; fi
  local py
  for py in "$ROOT/.venv/bin/python" python3; do
    if "$py" -m pip --version >/dev/null 2>&1; then
      "$py" -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | tail -1
      return
    fi
  done
}
mount_local() {  # bind-mount a local path named by a pip setting; $2=index: the folder above it too (an index's
  local p=${1#file://}   # pages may link to files beside it, e.g. DIR/simple/NAME/ -> DIR/files/...)
  p=${p%/}
  [ "$2" = index ] && p=$(dirname "$p")
  case "$p" in /?*) [ -e "$p" ] && VOLUMES+=(-v "$p:$p:ro") ;; esac
  return 0
}
for opt in index-url extra-index-url find-links; do
  val=$(pip_setting "$opt")
  [ -n "$val" ] || continue
  BUILD_ARGS+=(--build-arg "PIP_$(echo "$opt" | tr 'a-z-' 'A-Z_')=$val")
  for item in $val; do
    case "$opt" in find-links) mount_local "$item" links ;; *) case "$item" in file://*) mount_local "$item" index ;; esac ;; esac
  done
done
cert=$(pip_setting cert)
if [ -n "$cert" ] && [ -f "$cert" ]; then
  VOLUMES+=(-v "$cert:/run/kvship-build/ca.crt:ro")
  BUILD_ARGS+=(--build-arg PIP_CERT=/run/kvship-build/ca.crt)
fi
# Where the worker finds torch: TORCH_INDEX_URL when set; else, when a local find-links folder holds a +cpu
# torch wheel (this machine: /opt/wheels), the default index (that folder is searched beside it), so PyTorch's
# own index, unreachable here, is never asked; else the Dockerfile's default (PyTorch's index for the variant).
TORCH_ARGS=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
else
  for dir in $(pip_setting find-links); do
    if compgen -G "${dir#file://}/torch-*+cpu-*.whl" >/dev/null; then
      default_index=$(pip_setting index-url)
      TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=${default_index:-https://pypi.org/simple}")
      break
    fi
  done
fi

build() {  # name dockerfile tag [extra podman args...]
  local name=$1 file=$2 tag=$3; shift 3
  say "building $tag ($file)"
  local t0; t0=$(date +%s)
  nice -n 10 podman build --isolation chroot --network host --format docker --layers \
    -f "$ROOT/images/$file" -t "$tag" --build-arg "BASE=$BASE_IMAGE" \
    "${BUILD_ARGS[@]}" "${VOLUMES[@]}" "$@" "$ROOT"
  local secs=$(( $(date +%s) - t0 )) size
  size=$(podman image inspect --format '{{.Size}}' "$tag")
  say "built $tag in ${secs} s, $(( size / 1000000 )) MB"
  [ -z "${SUMMARY:-}" ] || echo "$name $tag $secs $size" >>"$SUMMARY"
}

for t in "${TARGETS[@]}"; do
  case "$t" in
    router) build router router.Dockerfile "$REPO/router:$TAG" ;;
    operator) build operator operator.Dockerfile "$REPO/operator:$TAG" ;;
    worker-cpu)
      build worker-cpu worker.Dockerfile "$REPO/worker:$TAG-cpu" --build-arg VARIANT=cpu "${TORCH_ARGS[@]}" ;;
    worker-cuda-check)
      build worker-cuda-check worker.Dockerfile "$REPO/worker:$TAG-cuda-check" --build-arg VARIANT=cuda "${TORCH_ARGS[@]}" ;;
  esac
done

if [ "${PRUNE:-0}" = 1 ]; then
  say "removing cached build layers (dangling images)"
  podman image prune -f >/dev/null
fi
