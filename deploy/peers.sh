#!/usr/bin/env bash
# Installs the real peers a test suite runs against, from Debian's packages, if they are missing:
#   deploy/peers.sh etcd-server dnsmasq-base     (make test: membership from etcd and from DNS)
#   deploy/peers.sh prometheus iproute2 ...      (make test-deploy, make test-multihost)
# Nothing is started here: each test starts its own server on loopback (or in its own namespaces) and stops it.
set -euo pipefail
declare -A BINARY=([etcd-server]=etcd [dnsmasq-base]=dnsmasq [prometheus]=prometheus [iproute2]=ip
                   [podman]=podman [debootstrap]=debootstrap)
missing=()
for package in "$@"; do
  command -v "${BINARY[$package]:-$package}" >/dev/null || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "deploy/peers.sh: ${missing[*]} missing; run as root or: apt-get install ${missing[*]}" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
