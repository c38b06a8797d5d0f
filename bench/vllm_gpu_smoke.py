"""GPU smoke of the vLLM backend: K/V capture on a GPU vLLM (FlashAttention, CUDA graphs) vs HF.

Checks what CPU CI cannot: the GPU cache-layout reader and capture with CUDA graphs on, by
comparing every layer's captured K/V with an HF prefill of the same ids (bf16, so the bar is
bf16 rounding, not 1e-4; a wrong layout reads O(1) garbage), plus greedy parity and timings.
Writes a tiny bf16 checkpoint unless --checkpoint names one (e.g. a full-size dummy one).

    python bench/vllm_gpu_smoke.py --out /tmp/smoke [--checkpoint DIR] [--eager]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from alpamayo_ros.core.types import NUM_HISTORY_POSES, DrivingInput, SamplingSettings

logger = logging.getLogger("vllm_gpu_smoke")
SCENES = {"1cam": ((1,), 2, None), "16img_route": ((0, 1, 2, 6), 4, "Turn right in 30m")}


def driving_input(cameras: tuple[int, ...], frames: int, route: str | None, seed: int = 0) -> DrivingInput:
    rng = np.random.default_rng(seed)
    xyz = np.zeros((NUM_HISTORY_POSES, 3), np.float32)
    xyz[:, 0] = -0.8 * np.arange(NUM_HISTORY_POSES - 1, -1, -1)
    return DrivingInput(
        images=rng.integers(0, 256, (len(cameras), frames, 320, 576, 3), dtype=np.uint8),
        camera_indices=cameras,
        frame_stamps_ns=np.zeros((len(cameras), frames), np.int64),
        t0_ns=1,
        ego_history_xyz=xyz,
        ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1)),
        route_text=route,
    )


def kv_error(cache: Any, oracle: Any) -> dict[str, float]:
    """Largest |dK|, |dV| over layers and valid columns, and the largest |K| for scale (a paged
    cache is copied out first, which checks the block read as well)."""
    cache = cache.materialized()
    worst_k = worst_v = scale = 0.0
    for k, v, rk, rv in zip(cache.keys, cache.values, oracle.keys, oracle.values):
        for row in range(k.shape[0]):
            length = int(cache.valid[row].sum()) if cache.valid is not None else k.shape[2]
            worst_k = max(worst_k, (k[row, :, :length].float() - rk[row, :, :length].float()).abs().max().item())
            worst_v = max(worst_v, (v[row, :, :length].float() - rv[row, :, :length].float()).abs().max().item())
            scale = max(scale, rk[row, :, :length].float().abs().max().item())
    return {"max_dk": worst_k, "max_dv": worst_v, "max_abs_k": scale}


def timed(fn: Any, repeats: int) -> tuple[Any, float]:
    """Result of the last call and the median wall time in ms (GPU synced)."""
    times, result = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return result, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs / compile")
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm_smoke_"))
    checkpoint = args.checkpoint or write_checkpoint(work / "tiny", dtype=torch.bfloat16)
    report: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}

    def save() -> None:
        (args.out / "vllm_gpu_smoke.json").write_text(json.dumps(report, indent=1))

    def section(name: str, fn: Any) -> None:
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-4000:]}
        logger.info("%s: %s", name, report[name])
        save()

    started = time.perf_counter()
    options = dict(gpu_memory_utilization=0.4, max_model_len=8192, max_num_seqs=args.samples, enforce_eager=args.eager)
    options["cache_dir"] = work
    vllm_pipe = Pipeline.from_checkpoint(
        checkpoint, backend="vllm", device="cuda", dtype="bfloat16", backend_options=options
    )
    report["vllm_load_s"] = time.perf_counter() - started
    import vllm

    report["vllm"] = vllm.__version__
    report["kv_layout"] = str(vllm_pipe.backbone._sink.layouts[0])  # noqa: SLF001 (diagnostic)
    hf_pipe = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cuda", dtype="bfloat16")
    save()
    ids = vllm_pipe.tokenizer.ids

    for name, (cameras, frames, route) in SCENES.items():
        inputs = driving_input(cameras, frames, route)

        def greedy(inputs: DrivingInput = inputs) -> dict[str, Any]:
            prompt = vllm_pipe.driving_prompt(inputs, vllm_pipe.preprocess(inputs))
            kw = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=40)
            ours, ms = timed(lambda: vllm_pipe.backbone.rollout(prompt, generator=torch.Generator("cuda"), **kw), 3)
            ref = hf_pipe.backbone.rollout(prompt, generator=torch.Generator("cuda"), **kw)
            oracle = hf_pipe.backbone.prefill(prompt, ours.generated_ids)
            return {
                "prompt_tokens": int(prompt.input_ids.shape[0]),
                "rollout_ms": ms,
                "same_ids_as_hf": ours.generated_ids == ref.generated_ids,
                "cache_len": ours.cache.length,
                "kv_vs_hf_prefill": kv_error(ours.cache, oracle),
            }

        section(f"greedy_{name}", greedy)

    def sampled() -> dict[str, Any]:
        inputs = driving_input((0, 1, 2, 6), 4, "Turn right in 30m", seed=1)
        prompt = vllm_pipe.driving_prompt(inputs, vllm_pipe.preprocess(inputs))
        kw = dict(num_samples=args.samples, temperature=0.6, top_p=0.98, max_new_tokens=40)
        generator = torch.Generator("cuda")
        ours, ms = timed(lambda: vllm_pipe.backbone.rollout(prompt, generator=generator.manual_seed(1), **kw), 3)
        traj = range(ids.traj_start, ids.traj_start + ids.traj_vocab_size)
        oracle = hf_pipe.backbone.prefill(prompt, ours.generated_ids)
        return {
            "rollout_ms": ms,
            "rows_stopped": sum(row[-1] == ids.traj_future_start for row in ours.generated_ids),
            "any_masked_token": any(t in traj for row in ours.generated_ids for t in row),
            "kv_vs_hf_prefill": kv_error(ours.cache, oracle),
        }

    section("sampled", sampled)

    def plans() -> dict[str, Any]:
        inputs = driving_input((0, 1, 2, 6), 4, "Turn right in 30m", seed=2)
        settings = SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=40)
        out = {}
        for label, pipe in (("vllm", vllm_pipe), ("hf", hf_pipe)):
            plan, ms = timed(lambda pipe=pipe: pipe.plan(inputs, settings), 3)
            out[label] = {"total_ms": ms, "stages_ms": plan.timings_ms, "tokens": len(plan.generated_ids[0])}
        cfg = SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=40, cfg_weight=1.5)
        plan, ms = timed(lambda: vllm_pipe.plan(inputs, cfg), 3)
        out["vllm_nav_cfg"] = {"total_ms": ms, "stages_ms": plan.timings_ms}
        return out

    section("plans", plans)
    vllm_pipe.backbone.close()


if __name__ == "__main__":
    main()
