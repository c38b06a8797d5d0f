#!/usr/bin/env bash
# The main job on the embedded default: set up .venv if needed, then run the closed-loop demo
# (tiny random checkpoint, synthetic road scene). Output lands in ./out/demo unless --out is given.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
export FASTDDS_BUILTIN_TRANSPORTS="DEFAULT?sockets_size=16777216"  # one host: see the README
export AMENT_PREFIX_PATH="$ROOT/.venv"
export PYTHONUNBUFFERED=1
exec "$ROOT/.venv/bin/alpamayo-demo" --out "$ROOT/out/demo" "$@"
