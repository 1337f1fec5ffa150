#!/usr/bin/env bash
# Makes what the manifests' Secrets hold, into DIR, and prints (or, with --apply, runs) the kubectl commands that
# create the Secrets from it:
#   deploy/k8s/make-secrets.sh DIR [--apply]
#   KVSTORE_NAMESPACE (default kvstore) names the namespace, which the daemons' certificate name carries.
# DIR gets: ca.crt, ca.key (a new CA: keep ca.key offline), tls.crt, tls.key (the daemons' certificate, for
# *.kvstore.NAMESPACE.svc.cluster.local, the names the SRV records give), tokens.toml (the daemons' token file,
# digests only), engine.token (kvstore-api's bearer token to the daemons: read, write), operator.token (yours, for
# `kvstore stats`: read, delete, admin), tenant-a.key and metrics.key (kvstore-api's API keys).
# Secrets are not kept in the repository: each cluster gets its own, made here or by your own PKI and vault.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [--apply]" >&2; exit 2; }
dir=$1
apply=${2:-}
ns=${KVSTORE_NAMESPACE:-kvstore}
umask 077
mkdir -p "$dir"
cd "$dir"

# A CA, and the daemons' certificate signed by it: one wildcard name covers kvstore-0, kvstore-1, ... as the
# client checks each daemon against its SRV target name, kvstore-N.kvstore.NAMESPACE.svc.cluster.local.
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days 3650 \
  -subj "/CN=kvstore CA ($ns)" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
  -subj "/CN=kvstore.$ns.svc.cluster.local" -keyout tls.key -out tls.csr 2>/dev/null
printf '%s\n' "subjectAltName=DNS:*.kvstore.$ns.svc.cluster.local,DNS:kvstore.$ns.svc.cluster.local" \
  "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 825 -extfile tls.ext \
  -out tls.crt 2>/dev/null
rm -f tls.csr tls.ext ca.srl
chmod 0644 ca.crt tls.crt

# Tokens: the daemons keep only their SHA-256 (kvstore/server/auth.py), the clients the token itself. Written
# without a newline: a token is read whole from the file, and whitespace is no part of one.
python3 - <<'PY'
import hashlib
import secrets

entries = []
for name, verbs in (("engine", ["read", "write"]), ("operator", ["read", "delete", "admin"])):
    token = "kvs_" + secrets.token_urlsafe(32)
    with open(f"{name}.token", "w") as f:
        f.write(token)
    entries.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
                   f'tenants = ["*"]\nverbs = {verbs!r}\n'.replace("'", '"'))
with open("tokens.toml", "w") as f:
    f.write("\n".join(entries))
for name in ("tenant-a", "metrics"):
    with open(f"{name}.key", "w") as f:
        f.write("sk-" + secrets.token_urlsafe(32))
PY

commands=(
  "kubectl -n $ns create secret generic kvstore-tokens --from-file=tokens.toml=$PWD/tokens.toml"
  "kubectl -n $ns create secret tls kvstore-daemon-tls --cert=$PWD/tls.crt --key=$PWD/tls.key"
  "kubectl -n $ns create secret generic kvstore-ca --from-file=ca.crt=$PWD/ca.crt"
  "kubectl -n $ns create secret generic kvstore-api-store-token --from-file=token=$PWD/engine.token"
  "kubectl -n $ns create secret generic kvstore-api-keys --from-file=tenant-a=$PWD/tenant-a.key --from-file=metrics=$PWD/metrics.key"
)
for command in "${commands[@]}"; do
  echo "$command"
  if [ "$apply" = --apply ]; then $command; fi
done
