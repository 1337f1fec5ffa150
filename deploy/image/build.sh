#!/usr/bin/env bash
# Builds the kvstore-server image (deploy/Dockerfile) from a Debian bookworm base made here with debootstrap:
#   deploy/image/build.sh [extra flags for `podman build`, e.g. --runtime runc]
# Settings from the environment:
#   KVSTORE_IMAGE     the tag to build        (default localhost/kvstore-server:0.1.0)
#   KVSTORE_BASE      "debootstrap" (default) or an image to build FROM, e.g. docker.io/library/python:3.11-slim
#   CONTAINER_ENGINE  podman (default) or docker
#   DEBIAN_MIRROR     for debootstrap          (default http://deb.debian.org/debian)
# The base is made once and kept as a tarball in deploy/image/.cache/ (ignored by git); delete it to remake it.
# Needs root for debootstrap and for the import (rootful podman).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=$here/.cache
engine=${CONTAINER_ENGINE:-podman}
tag=${KVSTORE_IMAGE:-localhost/kvstore-server:0.1.0}
base=${KVSTORE_BASE:-debootstrap}
mkdir -p "$cache"

if [ "$base" = debootstrap ]; then
  base=localhost/kvstore-base:bookworm
  tarball=$cache/base-bookworm.tar
  if [ ! -s "$tarball" ]; then
    rm -rf "$cache/rootfs"
    # minbase: essential packages and apt only; python3-venv brings venv and the pip wheel it seeds from
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$cache/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    rm -rf "$cache"/rootfs/var/cache/apt/archives/*.deb "$cache"/rootfs/var/lib/apt/lists/*
    tar -C "$cache/rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"  # a half-written tarball is never taken for the base
    rm -rf "$cache/rootfs"
  fi
  if ! "$engine" image inspect "$base" >/dev/null 2>&1; then
    "$engine" import --change 'CMD ["/bin/bash"]' "$tarball" "$base" >/dev/null
  fi
fi

# A build context of just what the image needs: the checkout's .venv (torch, gigabytes) and data stay out.
context=$cache/context
rm -rf "$context"
mkdir -p "$context/deploy/image"
cp "$root/pyproject.toml" "$root/README.md" "$context/"
cp "$root/deploy/Dockerfile" "$context/deploy/"
cp "$root/deploy/image/kvstore-probe" "$context/deploy/image/"
tar -C "$root" --exclude=__pycache__ --exclude='*_pb2.py' --exclude='*_pb2.pyi' -cf - proto kvstore \
  | tar -C "$context" -xf -

extra=()
ca=${PIP_CERT:-}
if [ -n "$ca" ] && [ -f "$ca" ] && [ "$engine" = podman ]; then
  # This host's pip trusts a CA bundle of its own (a proxy in front of PyPI, say): lend it to the build's pip
  # for the build only; it is mounted, so it is in no layer of the image.
  extra+=(--volume "$(readlink -f "$ca"):/run/kvstore-build-ca.pem:ro" --build-arg BUILD_CA=/run/kvstore-build-ca.pem)
fi
# --network host: the build's pip reaches PyPI without a container network being set up
"$engine" build --network host --build-arg "BASE=$base" ${extra[@]+"${extra[@]}"} -f "$context/deploy/Dockerfile" \
  -t "$tag" "$@" "$context"
echo "built $tag (FROM $base)"
