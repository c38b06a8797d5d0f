#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (unit, ROS across processes,
# vLLM on CPU). Extra arguments go to pytest (e.g. `bash scripts/test.sh -k frame_sync`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
# UDP discovery, shared-memory data with room for big frames; why not LARGE_DATA: alpamayo_ros/testing/rig.py
export FASTDDS_BUILTIN_TRANSPORTS="DEFAULT?sockets_size=16777216"
export AMENT_PREFIX_PATH="$ROOT/.venv"          # get_package_share_directory() without sourcing
export PYTHONUNBUFFERED=1
# Two workers, a test file each at a time (see test/conftest.py); `-n 0` runs in this process.
# The 15 slowest tests are listed at the end, to keep the suite well under 30 min.
# pytest exits 5 when nothing was collected: that is a failure here too.
exec "$ROOT/.venv/bin/python" -m pytest test -p no:cacheprovider -rfEs --timeout=900 --durations=15 -n 2 --dist loadfile --no-loadscope-reorder "$@"
