#!/usr/bin/env bash
# One engine's virtual environment for the connector tests: .venvs/<lock>/ from deploy/connectors/<lock>.txt.
#   deploy/connectors/venv.sh lmcache-0.5.6
# torch 2.13.0 first (the cached CPU build), then the engine and its leaf dependencies exactly as locked and
# --no-deps (so nothing re-resolves torch or pulls CUDA wheels), then this project with its test tools.
set -euo pipefail
cd "$(dirname "$0")/../.."
lock=${1:?usage: deploy/connectors/venv.sh LOCK (one of: $(cd deploy/connectors && ls *.txt | sed 's/\.txt$//' | tr '\n' ' '))}
[ -f "deploy/connectors/$lock.txt" ] || { echo "no lock file deploy/connectors/$lock.txt" >&2; exit 2; }
venv=.venvs/$lock
stamp=$venv/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt "deploy/connectors/$lock.txt" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
PY=${PY:-$(command -v python3.11 || command -v python3)}
"$PY" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps -r "deploy/connectors/$lock.txt"
"$venv/bin/pip" install -q -e . "pytest>=8" "pytest-timeout>=2.3" "grpcio-tools>=1.66"
touch "$stamp"
