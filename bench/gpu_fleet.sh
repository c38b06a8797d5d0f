#!/usr/bin/env bash
# One GPU Ray worker of `alpamayo-eval --ray` on the lent H200 (issue 15): bench_fleet.py with the
# full-size random checkpoint on vLLM and W16's cameras (0, 1, 2, 6 as 1080x1920 JPEG at 10 Hz),
# planned at 10 Hz, then the single-process evaluator on the same bags. Logs and JSON go to $OUT.
#
# Ray and the vLLM bundle do not fit in one call, so this runs in the call right after a
# bench/gpu_run.sh call on the same warm machine: that one leaves vLLM in /tmp/site and the
# checkpoint in /tmp/ckpt (written here if absent). Build the Ray bundle here first:
#   bash bench/ray_bundle.sh .ray312      # Ray + rosbags for Python 3.12, ~28 MB
# then (device tool, carry=[".ray312"]):  bash bench/gpu_fleet.sh [bench_fleet.py args...]
# BAGS and DURATION_S size the run (default 2 bags of 15 s: ~140 plans per run).
set -uo pipefail
OUT=${OUT:?gpu_fleet: OUT (the folder that comes back) is not set}
if [[ ! -f /tmp/site/vllm/__init__.py ]]; then
  echo "gpu_fleet: no vLLM bundle in /tmp/site: run bench/gpu_run.sh in the call before this one, on the same warm machine" >&2
  exit 1
fi
if [[ ! -f .ray312/raysite.tar.xz ]]; then
  echo "gpu_fleet: .ray312/raysite.tar.xz is missing: run bash bench/ray_bundle.sh .ray312 and carry .ray312" >&2
  exit 1
fi
mkdir -p /tmp/raysite && tar -C /tmp/raysite -xJf .ray312/raysite.tar.xz || exit 1
export PYTHONPATH=/tmp/raysite:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Ray must see the GPU, or the worker that asks for one waits (until --timeout-s)
python3 -c "import ray, rosbags.rosbag2; ray.init(num_cpus=1, include_dashboard=False); print('ray', ray.__version__, ray.cluster_resources())" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 bench/bench_fleet.py --full-size-dir /tmp/ckpt --backend vllm --device cuda --gpus-per-worker 1 --workers 1 \
  --single --cameras 0 1 2 6 --image-size 1920x1080 --rate-hz 10 --ticks 0 --max-reasoning-tokens 40 \
  --bags "${BAGS:-2}" --duration-s "${DURATION_S:-15}" --timeout-s 270 --json-dir "$OUT" "$@" 2>&1 \
  | tee "$OUT/fleet.log" | grep -v -E "^(INFO|DEBUG)"
