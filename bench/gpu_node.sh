#!/usr/bin/env bash
# Node-level latency on the GPU machine (issue 7): bench_node.py's three processes (cameras,
# drive node, listener) with the node on the H200.
#
# The GPU machine has Python 3.12, torch and a C/C++ toolchain but no ROS and no network, and
# one call carries at most 64 MiB, which the ROS wheels and the vLLM bundle do not fit in
# together. So:
#   here:        bash bench/gpu_node.sh prepare    # .ros312/: cp312 ROS wheels + a trimmed CMake
#   the device:  bash bench/gpu_node.sh run [bench_node.py args...]
# `run` uses the vLLM bundle and the full-size checkpoint that bench/gpu_run.sh left in /tmp when
# the machine is still warm from it (device tool: carry=[".ros312", ".whl"] in the next call);
# on a fresh machine it falls back to the HF backend and writes the checkpoint itself.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY="$ROOT/.ros312"
cd "$ROOT"

prepare() {  # needs .venv (scripts/setup.sh): the ROS closure is read from its metadata
  rm -rf "$CARRY" && mkdir -p "$CARRY"
  .venv/bin/python - requirements/ros.txt > "$CARRY/closure.txt" <<'EOF'
import importlib.metadata as md, re, sys
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
def dist(name):
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:  # some installs only answer to the underscore spelling
        return md.distribution(name.replace("-", "_"))
todo = [norm(l.split("==")[0].strip()) for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")]
seen = set()
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    for req in dist(name).requires or []:
        if "extra ==" not in req:
            todo.append(norm(re.split(r"[ ;<>=!~\[(]", req)[0]))
host = {"numpy", "packaging", "pyyaml", "setuptools", "typing-extensions"}  # the GPU machine has these
print("\n".join(f"{n}=={dist(n).version}" for n in sorted(seen - host)))
EOF
  # cp312 builds of the same versions (the pure-Python ones are version-free)
  .venv/bin/python -m pip download -q --no-deps -d "$CARRY" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -r <(grep -v -E "^(empy|lark-parser)==" "$CARRY/closure.txt") 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip download -q --no-deps -d "$CARRY" \
    $(grep -E "^(empy|lark-parser)==" "$CARRY/closure.txt") 2>&1 \
    | grep -v "is ignored" || true
  # CMake for the message build: the binary and its modules only (7 of 30 MB)
  local tmp
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps -d "$tmp" --only-binary=:all: \
    --platform manylinux_2_17_x86_64 cmake 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m zipfile -e "$tmp"/cmake-*.whl "$tmp/x"
  tar -C "$tmp/x/cmake/data" -cf - bin/cmake $(cd "$tmp/x/cmake/data" && ls -d share/cmake-*/Modules share/cmake-*/Templates) \
    | xz -9 -T0 > "$CARRY/cmake.tar.xz"
  rm -rf "$tmp"
  du -sh "$CARRY"
}

run() {
  local venv=/tmp/rosvenv tool
  for tool in cc c++ python3; do
    command -v "$tool" > /dev/null || { echo "gpu_node: $tool is missing on this machine" >&2; exit 1; }
  done
  # python3 may itself be a venv (torch's): its packages reach ours through a .pth file
  python3 -m venv --without-pip "$venv"
  python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/host.pth"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
    "$CARRY"/*.whl "$CARRY"/*.tar.gz .whl/*.whl
  mkdir -p /tmp/cmake && tar -C /tmp/cmake -xJf "$CARRY/cmake.tar.xz" && chmod +x /tmp/cmake/bin/cmake
  PATH=/tmp/cmake/bin:$PATH bash scripts/build_msgs.sh "$venv"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation . > /tmp/install.log 2>&1 \
    || { cat /tmp/install.log; exit 1; }  # not editable: setup.cfg's ROS [develop] section trips older setuptools
  export AMENT_PREFIX_PATH=$venv PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
  local backend=hf
  if [[ -d /tmp/site/vllm && -f /tmp/ckpt/config.json ]]; then
    backend=vllm
    export PYTHONPATH=/tmp/site
  else
    echo "gpu_node: no vLLM bundle or checkpoint left in /tmp (fresh machine): HF backend"
    "$venv/bin/python" -c "import torch; from pathlib import Path; from alpamayo_ros.core.tiny_checkpoint import write_checkpoint; \
write_checkpoint(Path('/tmp/ckpt'), full_size=True, weights=True, dtype=torch.bfloat16, device='cuda')"
  fi
  "$venv/bin/python" bench/bench_node.py --checkpoint /tmp/ckpt --backend "$backend" --device cuda "$@"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare | run [bench_node.py args...]" >&2; exit 2 ;;
esac
