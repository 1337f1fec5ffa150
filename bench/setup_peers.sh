#!/usr/bin/env bash
# Installs the peers that bench/dataplane.py measures against, on a fresh Debian machine:
#   redis-server (Debian package) and the redis client library;
#   Mooncake Store from PyPI (mooncake-transfer-engine-non-cuda), with the RDMA/netlink libraries its
#   binaries link against unpacked (not installed) into bench/.peers/lib.
# Idempotent; prints the LD_LIBRARY_PATH line to use.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PEERS=bench/.peers
mkdir -p "$PEERS/debs" "$PEERS/lib"

if ! command -v redis-server >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
"$VENV/bin/pip" install -q 'redis[hiredis]>=5' 'mooncake-transfer-engine-non-cuda==0.3.13.post1'

if [ ! -e "$PEERS/lib/.done" ]; then
  apt-get update -qq
  (cd "$PEERS/debs" && apt-get download -qq libibverbs1 libnl-3-200 libnl-route-3-200)
  for deb in "$PEERS"/debs/*.deb; do dpkg-deb -x "$deb" "$PEERS/lib/root"; done
  for so in "$PEERS"/lib/root/usr/lib/*/*.so* "$PEERS"/lib/root/lib/*/*.so*; do
    [ -e "$so" ] && cp -a "$so" "$PEERS/lib/"
  done
  touch "$PEERS/lib/.done"
fi
echo "peers ready: redis-server $(redis-server --version | awk '{print $3}'), mooncake libs in $PEERS/lib"
