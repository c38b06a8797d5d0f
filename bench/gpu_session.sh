#!/usr/bin/env bash
# The open GPU measurements as named steps, so a session's device time goes into few calls on one
# warm machine. Each step runs under its own time guard, writes its JSON and log under $OUT and
# prints its report; a failed or timed-out step does not stop the next. Run from the unpacked
# snapshot (see bench/README.md, "On the lent H200"), e.g. in three calls of under 600 s:
#   bash bench/gpu_session.sh parity w16            # ~9 min on a fresh machine
#   bash bench/gpu_session.sh s16 fp8               # ~6 min (W16-s16, W16-fp8)
#   bash bench/gpu_session.sh speculation           # ~6 min
# Steps:
#   parity       the expert's fast paths against fp32 (fp8 auto: cutlass <= 256 rows), exit 1 on a mismatch
#   parity-autotune  the same with inductor's max-autotune for the GEMMs of the compiled layer step
#                (Triton templates benchmarked against cuBLAS per shape on this GPU)
#   parity-deterministic  the same with TORCHINDUCTOR_DETERMINISTIC=1 and a fresh inductor cache: what
#                reductions configured without on-device timing cost the expert (the same plan in every run)
#   parity-pdl   the same with TORCHINDUCTOR_ENABLE_PDL=1 and a fresh inductor cache: inductor's Triton kernels
#                launched as programmatic dependent launches (each may start while the one before finishes,
#                also inside a CUDA graph), against the ~2.5 us a kernel that a 1-row call pays between kernels
#   w16          W16 on vLLM and HF in one run (the HF/vLLM ratio), 30 timed vLLM plans
#   w16-pdl      W16 on vLLM alone with TORCHINDUCTOR_ENABLE_PDL=1 and fresh vLLM/inductor caches (backbone and
#                expert compiled with programmatic dependent launches), to hold against the w16 step's vLLM figures
#   s16          W16-s16 on vLLM (16 samples over one prompt)
#   s16-cascade  W16-s16 and W16-s16-cascade on vLLM in one run (cascade attention against none),
#                both on vLLM's V1 model runner (cascade needs it), so only the cascade differs
#   speculation  W16, $DRAFT draft tokens (default 4): the four regimes, exact check, drafts looked up on the GPU
#                (vLLM scheduling asynchronously); bench_pipeline's --profile-dir adds traces, more
#                files than one call brings back
#   speculation-host  the same with drafts looked up on the host (vLLM scheduling synchronously)
#   speculation-trace the device regimes over 10 plans each, one plan per regime traced by the torch
#                profiler, the tables and traces packed into one file (speculation-trace.tgz)
#   speculation-fp8   the device regimes on W16-fp8 (FP8 backbone and expert)
#   speculation-deterministic  the device regimes with TORCHINDUCTOR_DETERMINISTIC=1 and fresh compile
#                caches: inductor then picks each reduction kernel's config (RMSNorm's block and warps)
#                without timing it on the device, so both engines sum a row alike in every run
#   speculation-invariant  the device regimes with VLLM_BATCH_INVARIANT=1 (no split-K GEMMs on Hopper):
#                whether verified tokens then get the K/V decoded ones get (dxyz 0), and at what cost
#   fp8          W16-fp8 on vLLM (FP8 backbone and expert)
#   fp8-marlin   W16-fp8 with vLLM's FP8 Marlin (weight-only, bf16 activations) in every backbone linear
#                layer instead of its Hopper default (cutlass W8A8, activations quantised per token)
#   gemm         bench.fp8_gemm_bench: the backbone's and the expert's GEMMs, bf16 against every FP8
#                kernel vLLM offers, at decode, prefill and expert row counts (no model loaded)
#   profile      bench.prefill_profile on W16: GPU time per stage of whole plans (vision tower, decoder
#                parts, prefill and decode apart) and what a slow preprocess does
#   profile-fp8  the same on W16-fp8 (FP8 backbone): where its prefill loses to bf16
#   profile-s16  the same on W16-s16: where a 16-row decode step spends its time over a 1-row one
# Setup happens once per machine: the vLLM bundle into /tmp, the tokenizer wheels into /tmp/site,
# the full-size random checkpoint into /tmp/ckpt (the first step that needs it writes it).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
RUNS=${RUNS:-30}
DRAFT=${DRAFT:-4}  # draft tokens per step of the speculation steps
if [ ! -d /tmp/site/vllm ]; then
  cat .gpu/bundle.tar.xz.part-* | xz -d -T0 | tar -C /tmp -x
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/gpu.txt"

checkpoint() {  # reuse /tmp/ckpt once a step has written it whole (its shard index comes last)
  if [ -f /tmp/ckpt/model.safetensors.index.json ]; then echo "--checkpoint /tmp/ckpt"; else echo "--full-size-dir /tmp/ckpt"; fi
}

report() {  # a step's log without vLLM's and torch's own lines
  grep -v -E "^(INFO|DEBUG|WARNING|\[|[0-9]{4}-)|Loading|it/s\]" "$1" | tail -"${2:-60}" | cut -c1-240
}

step() {  # step NAME GUARD_S COMMAND...
  local name=$1 guard=$2
  shift 2
  local start=$SECONDS
  timeout "$guard" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code after $((SECONDS - start)) s (guard $guard s)"
  report "$OUT/$name.log"
}

for name in "$@"; do
  case $name in
    parity) step parity 200 python3 -m bench.expert_parity --runs 10 --fp8-kernel auto --out "$OUT/parity_auto.json" ;;
    parity-autotune) step parity-autotune 330 env TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 python3 -m bench.expert_parity \
           --runs 10 --fp8-kernel auto --out "$OUT/parity_autotune.json" ;;
    parity-deterministic) step parity-deterministic 200 env TORCHINDUCTOR_DETERMINISTIC=1 \
           TORCHINDUCTOR_CACHE_DIR=/tmp/cache-deterministic/expert python3 -m bench.expert_parity --runs 10 \
           --fp8-kernel auto --out "$OUT/parity_deterministic.json" ;;
    parity-pdl) step parity-pdl 200 env TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_CACHE_DIR=/tmp/cache-pdl/expert \
           python3 -m bench.expert_parity --runs 10 --fp8-kernel auto --out "$OUT/parity_pdl.json" ;;
    w16) step w16 330 python3 bench/bench_pipeline.py --workload W16 $(checkpoint) --backends vllm,hf \
           --runs "$RUNS" --compare-runs 20 --json-dir "$OUT" ;;
    w16-pdl) step w16-pdl 330 env TORCHINDUCTOR_ENABLE_PDL=1 VLLM_CACHE_ROOT=/tmp/cache-pdl/vllm \
           TORCHINDUCTOR_CACHE_DIR=/tmp/cache-pdl/inductor python3 bench/bench_pipeline.py --workload W16 $(checkpoint) \
           --backends vllm --runs "$RUNS" --json-dir "$OUT/pdl" ;;
    s16) step s16 300 python3 bench/bench_pipeline.py --workload W16-s16 $(checkpoint) --backends vllm --runs "$RUNS" \
           --json-dir "$OUT" ;;
    s16-cascade) step s16-cascade 400 env VLLM_USE_V2_MODEL_RUNNER=0 python3 bench/bench_pipeline.py \
           --workload W16-s16,W16-s16-cascade $(checkpoint) --backends vllm --runs "$RUNS" --json-dir "$OUT" ;;
    speculation) step speculation 420 python3 bench/bench_pipeline.py --workload W16 --speculation "$DRAFT" \
           --speculation-proposer device --exact $(checkpoint) --runs "$RUNS" --json-dir "$OUT" ;;
    speculation-host) step speculation-host 420 python3 bench/bench_pipeline.py --workload W16 --speculation "$DRAFT" \
           --speculation-proposer host --exact $(checkpoint) --runs "$RUNS" --json-dir "$OUT/host" ;;
    speculation-trace) step speculation-trace 420 python3 bench/bench_pipeline.py --workload W16 --speculation "$DRAFT" \
           --speculation-proposer device $(checkpoint) --runs 10 --json-dir "$OUT/trace" --profile-dir /tmp/prof
         tar -C /tmp -czf "$OUT/speculation-trace.tgz" prof ;;
    speculation-deterministic) step speculation-deterministic 420 env TORCHINDUCTOR_DETERMINISTIC=1 \
           VLLM_CACHE_ROOT=/tmp/cache-deterministic/vllm TORCHINDUCTOR_CACHE_DIR=/tmp/cache-deterministic/inductor \
           python3 bench/bench_pipeline.py --workload W16 --speculation "$DRAFT" --speculation-proposer device \
           $(checkpoint) --runs "$RUNS" --json-dir "$OUT/deterministic" ;;
    speculation-invariant) step speculation-invariant 420 env VLLM_BATCH_INVARIANT=1 python3 bench/bench_pipeline.py \
           --workload W16 --speculation "$DRAFT" --speculation-proposer device $(checkpoint) --runs "$RUNS" \
           --json-dir "$OUT/invariant" ;;
    speculation-fp8) step speculation-fp8 420 python3 bench/bench_pipeline.py --workload W16-fp8 --speculation "$DRAFT" \
           --speculation-proposer device --exact $(checkpoint) --runs "$RUNS" --json-dir "$OUT" ;;
    fp8) step fp8 300 python3 bench/bench_pipeline.py --workload W16-fp8 $(checkpoint) --backends vllm \
           --runs "$RUNS" --json-dir "$OUT" ;;
    fp8-marlin) step fp8-marlin 300 env VLLM_TEST_FORCE_FP8_MARLIN=1 python3 bench/bench_pipeline.py --workload W16-fp8 \
           $(checkpoint) --backends vllm --runs "$RUNS" --json-dir "$OUT/marlin" ;;
    gemm) step gemm 200 python3 -m bench.fp8_gemm_bench --json-dir "$OUT" ;;
    profile) step profile 420 python3 -m bench.prefill_profile --workload W16 --full-size-dir /tmp/ckpt --json-dir "$OUT" ;;
    profile-fp8) step profile-fp8 420 python3 -m bench.prefill_profile --workload W16-fp8 --full-size-dir /tmp/ckpt \
           --json-dir "$OUT" ;;
    profile-s16) step profile-s16 420 python3 -m bench.prefill_profile --workload W16-s16 --full-size-dir /tmp/ckpt \
           --json-dir "$OUT" ;;
    *) echo "unknown step '$name' (parity, parity-autotune, parity-deterministic, parity-pdl, w16, w16-pdl, s16, s16-cascade, speculation, speculation-host, speculation-trace, speculation-fp8, speculation-deterministic, speculation-invariant, fp8, fp8-marlin, gemm, profile, profile-fp8, profile-s16)"; exit 2 ;;
  esac
done
