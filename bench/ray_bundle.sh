#!/usr/bin/env bash
# Ship Ray and rosbags to the lent H200 (issue 15): the device has neither and no network, and
# Ray's cp312 wheel alone (79 MB) exceeds what one call may carry beside the working tree.
# This downloads the pinned ray and rosbags (requirements/gpu.txt) plus the deps the device image
# lacks (checked against the device's KINDS.md package list), drops the Ray libraries that
# `alpamayo-eval --ray` never imports (RLlib, Serve, Train, Tune, LLM, Java jars, the dashboard's web
# frontend), strips Ray's three binaries and packs one OUTDIR/raysite.tar.xz (~28 MB).
#
#   bash bench/ray_bundle.sh [OUTDIR=.ray312] [PYTHON_VERSION=3.12]
# On the device:  mkdir -p /tmp/raysite && tar -C /tmp/raysite -xJf .ray312/raysite.tar.xz
#                 export PYTHONPATH=/tmp/raysite:$PYTHONPATH
# PYTHON_VERSION=3.11 builds the same trimmed bundle for this machine's venv (to test the trimming).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/.ray312}" && cd "${1:-$ROOT/.ray312}" && pwd)
PYVER=${2:-3.12}
PYTHON=${PYTHON:-python3}
pin() { grep -h -E "^$1==" "$ROOT/requirements/gpu.txt" | head -1; }
W=$(mktemp -d /tmp/raybundle.XXXXXX)
trap 'rm -rf "$W"' EXIT
PLAT="--no-deps --only-binary=:all: --python-version $PYVER --implementation cp --platform any"
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64; do PLAT="$PLAT --platform $p"; done
# Missing on the device: jsonschema's stack (Ray's runtime-env schemas; the same versions as the
# vLLM bundle, so either copy may come first on PYTHONPATH) and rosbags' apsw, lz4,
# backports.zstd and ruamel.yaml. Ray's other deps (click, filelock, msgpack, packaging,
# protobuf, pyyaml, requests, aiohttp, grpcio) are in the device image.
"$PYTHON" -m pip download -q $PLAT -d "$W/whl" "$(pin ray)" "$(pin rosbags)" \
  apsw==3.54.1.0 lz4==4.4.5 backports.zstd==1.8.0 ruamel.yaml==0.19.1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  2>&1 | grep -v "is ignored" || true
mkdir -p "$W/site" && cd "$W/site"
for w in "$W"/whl/*.whl; do unzip -q -o "$w"; done
rm -rf ray/jars ray/rllib ray/serve ray/train ray/tune ray/llm ray/dashboard/client
strip ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server ray/_raylet.so
find . -name __pycache__ -prune -exec rm -rf {} +
tar -cf - . | xz -6 -T2 > "$OUT/raysite.tar.xz"
ls -l "$OUT/raysite.tar.xz"
