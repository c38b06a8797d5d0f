"""Where the vLLM backend's decode time goes: per-token decode of the W16 prompt with and
without each thing our backend adds to a stock engine (the <i*> logits mask, the K/V capture).
A diagnostic for issue 7; figures go to bench/RESULTS.md. (A second, stock engine in the same
process fails at CUDA-graph capture in vLLM 0.26, so "neither" stands in for stock vLLM.)

By default the engine masks in the model (EngineOptions.mask_in_model, the backend's default):
no logits processor is registered and the variants' mask is filled in by the model's
compute_logits. --token-mask builds the engine with the TokenMask logits processor instead
(its registration alone makes vLLM wait for each step's tokens); a separate run for the same
reason, whose "no mask" variants then still carry the registered processor.

    python -m bench.decode_probe --full-size-dir /tmp/ckpt --json $OUT/decode_probe.json
    python -m bench.decode_probe --full-size-dir /tmp/ckpt --token-mask --json $OUT/decode_probe_token_mask.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from bench.bench_pipeline import WORKLOADS, synthetic_inputs

logger = logging.getLogger("decode_probe")
TOKENS = 40


def measure(run: Callable[[], dict[str, float]], repeats: int) -> dict[str, float]:
    """p50 of frontend/prefill/decode ms and decode ms per token over repeats (after one warm-up)."""
    samples: dict[str, list[float]] = {}
    for index in range(repeats + 1):
        timings = run()
        if index:
            for key, value in timings.items():
                samples.setdefault(key, []).append(value)
    result = {key: float(np.median(values)) for key, values in samples.items()}
    result["decode_ms_per_token"] = result["decode"] / (TOKENS - 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-size-dir", type=Path, help="full-size random checkpoint (written if absent)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU (checks the script only)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--token-mask", action="store_true", help="mask with TokenMask, not in the model")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="probe-ckpt-")))
        device, dtype, options = "cpu", "float32", {"enforce_eager": True, "kv_cache_gib": 1.0}
        workload = WORKLOADS["smoke"]
    else:
        checkpoint = args.full_size_dir
        if not (checkpoint / "config.json").exists():
            write_checkpoint(checkpoint, full_size=True, weights=True, dtype=torch.bfloat16, device="cuda")
        device, dtype, options = "cuda", "bfloat16", {"gpu_memory_utilization": 0.3, "kv_cache_gib": 2.0}
        workload = WORKLOADS["W16"]
    options["mask_in_model"] = not args.token_mask
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", device=device, dtype=dtype, backend_options=options)
    backbone = pipeline.backbone
    adapter = backbone._adapter
    inputs = next(synthetic_inputs(workload, seed=0))
    prompt = pipeline.driving_prompt(inputs, pipeline.preprocess(inputs))
    (request,) = backbone._requests(prompt, [()])
    ids = pipeline.tokenizer.ids
    mask = adapter.MaskSpec(ids.traj_start, ids.traj_start + ids.traj_vocab_size, min_tokens=TOKENS,
                            early_ids=(ids.traj_future_start, ids.im_end))

    # min_tokens = max_tokens: fixed length, which the in-model mask serves too
    request_mask, model_mask = (mask, None) if args.token_mask else (None, mask)

    def engine_run(llm: Any, sink: Any, with_mask: bool, capture: bool) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            timings: dict[str, float] = {}
            params = adapter.sampling_params(temperature=0.0, top_p=1.0, max_tokens=TOKENS, seed=0,
                                             mask=request_mask if with_mask else None)
            adapter.run_requests(llm, sink, [(request, params)], stop_after=None, capture=capture, timings=timings,
                                 model_mask=model_mask if with_mask else None)
            return timings
        return run

    results: dict[str, dict[str, float]] = {}
    llm, sink = backbone._llm, backbone._sink
    kind = "TokenMask" if args.token_mask else "in-model mask"
    for name, with_mask, capture in [
        (f"ours: {kind} + K/V capture", True, True),
        (f"{kind}, no capture", True, False),
        ("capture, no mask", False, True),
        ("neither (connector still configured)", False, False),
    ]:
        results[name] = measure(engine_run(llm, sink, with_mask, capture), args.repeats)
        logger.info("%s: %s", name, results[name])
    for name, values in results.items():
        print(f"| {name} | " + " | ".join(f"{k}={v:.2f}" for k, v in values.items()) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    os._exit(0)  # skip vLLM's slow teardown; everything is written


if __name__ == "__main__":
    main()
