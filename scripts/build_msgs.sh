#!/usr/bin/env bash
# Build alpamayo_ros_msgs with plain CMake and install it into the venv given as $1, so
# `python -c "import alpamayo_ros_msgs.msg"` works from that venv without sourcing anything.
# Idempotent: skips the build when the installed messages were built from the same sources.
# Workarounds for the PyPI ROS wheels (docs: ros2_on_pypi.md section 2):
#   1. build-time deps are not declared by the wheels: requirements/ros.txt names them;
#   2. the wheels' exported CMake targets point at the wheel builder's Python: patched below;
#   3. no ament_lint_auto on PyPI: BUILD_TESTING=OFF.
set -euo pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: $0 VENV_DIR" >&2
  exit 2
fi
VENV=$(cd "$1" && pwd)
PY="$VENV/bin/python"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC="$ROOT/alpamayo_ros_msgs"
BUILD="$ROOT/build/alpamayo_ros_msgs"
STAMP="$VENV/share/alpamayo_ros_msgs/.source-hash"

want=$(cd "$SRC" && find . -type f | sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$PY" -c "import alpamayo_ros_msgs.msg" 2>/dev/null; then
  echo "build_msgs: alpamayo_ros_msgs is up to date"
  exit 0
fi

# Workaround 2: point the exported targets at this venv's Python and numpy headers.
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
NPINC=$("$PY" -c "import numpy; print(numpy.get_include())")
PYVER=$("$PY" -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
BAKED=/opt/python/cp${PYVER/./}-cp${PYVER/./}  # the wheel builder's interpreter for this Python version
# Nothing left to patch (a venv patched by an earlier build) is fine: grep's status 1 is not a failure.
{ grep -rl "$BAKED/" "$VENV/share" --include='*.cmake' 2>/dev/null || true; } | xargs -r sed -i \
  -e "s#$BAKED/include/python$PYVER#$PYINC#g" \
  -e "s#$BAKED/lib/python$PYVER/site-packages/numpy/_core/include#$NPINC#g"

echo "build_msgs: building alpamayo_ros_msgs into $VENV"
rm -rf "$BUILD"  # a cache from another venv or source tree would point at the wrong paths
cmake -S "$SRC" -B "$BUILD" -Wno-dev \
  -DCMAKE_PREFIX_PATH="$VENV" -DCMAKE_INSTALL_PREFIX="$VENV" \
  -DPython3_EXECUTABLE="$PY" -DBUILD_TESTING=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" >/dev/null
cmake --install "$BUILD" >/dev/null
"$PY" -c "import alpamayo_ros_msgs.msg as m; m.TrajectorySet(); m.Reasoning(); m.StageTimings()"
echo "$want" > "$STAMP"
echo "build_msgs: done"
