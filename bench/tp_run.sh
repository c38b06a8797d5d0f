#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2): tensor parallel TP=2 against TP=1.
# Unpacks the vLLM bundle as gpu_run.sh does, writes the full-size random checkpoint once,
# then runs `python3 -m bench.tp_bench` at TP=1 and at TP=2 (separate processes, one after the other):
# parity (greedy, exactly 40 tokens, same flow noise) and W16 / W16-s16 per stage. JSON and
# logs go to $OUT (tp1.json, tp2.json with "vs_reference", gpu.txt, tp*.log). Usage:
#   bash bench/tp_run.sh                 # W16,W16-s16, RUNS=30
#   RUNS=50 bash bench/tp_run.sh W16
set -uo pipefail
cat .gpu/bundle.tar.xz.part-* | xz -d -T0 | tar -C /tmp -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
workloads="${1:-W16,W16-s16}"
for tp in 1 2; do
  reference=()
  [ "$tp" -gt 1 ] && reference=(--reference "$OUT/tp1.json")
  python3 -m bench.tp_bench --tp "$tp" --checkpoint /tmp/ckpt --workload "$workloads" --runs "${RUNS:-30}" \
    --out "$OUT/tp$tp.json" "${reference[@]}" 2>&1 | tee "$OUT/tp$tp.log" | grep -v -E "^(INFO|DEBUG|\(Worker)" | tail -60
done
