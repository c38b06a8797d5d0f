"""`alpamayo-serve`: load one Pipeline, warm it up, serve it over HTTP (uvicorn).

    alpamayo-serve --checkpoint CKPT [--backend vllm|hf] [--device cuda] [--host 127.0.0.1]
                   [--port 8000] [--api-key KEY] [--queue-size 4] [--max-body-mb 64] [--body-timeout-s 30]
                   [--[no-]shm]

The port opens at once; /health answers 503 until the pipeline is loaded and has planned one
warm-up request, so a supervisor can wait on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import uvicorn

from ..core.pipeline import BACKENDS, Pipeline
from ..core.types import (
    CASCADE_MODES,
    EXPERT_QUANTIZATIONS,
    FRAME_SPACING_S,
    FRAMES_PER_CAMERA,
    NUM_HISTORY_POSES,
    SPECULATION_METHODS,
    SPECULATION_PROPOSERS,
    DrivingInput,
    SamplingSettings,
)
from .app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, ServerOptions, create_app
from .requests import Limits, RequestError, checked_settings
from .shm import is_loopback
from .worker import PipelineWorker

logger = logging.getLogger("alpamayo_serve")

#: Warm-up plan: the front camera at a size the vision tower takes as is, a short reasoning.
WARMUP_SIZE = (320, 576)
WARMUP_SETTINGS = SamplingSettings(temperature=0.0, max_reasoning_tokens=8, min_reasoning_tokens=8)
#: /predict requests carry no settings; these follow the Autoware sidecar's defaults (greedy, 64 tokens).
SIDECAR_SETTINGS = SamplingSettings(temperature=0.0, top_p=1.0, max_reasoning_tokens=64)


def warmup_input() -> DrivingInput:
    """One synthetic plan request (front camera, 4 frames, straight history)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (1, FRAMES_PER_CAMERA, *WARMUP_SIZE, 3), dtype=np.uint8)
    t0_ns = 10**10
    stamps = t0_ns - int(FRAME_SPACING_S * 1e9) * np.arange(FRAMES_PER_CAMERA - 1, -1, -1, dtype=np.int64)
    xyz = np.zeros((NUM_HISTORY_POSES, 3), dtype=np.float32)
    xyz[:, 0] = np.arange(-(NUM_HISTORY_POSES - 1), 1, dtype=np.float32)
    rot = np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1))
    return DrivingInput(images=images, camera_indices=(1,), frame_stamps_ns=stamps[None], t0_ns=t0_ns,
                        ego_history_xyz=xyz, ego_history_rot=rot)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alpamayo-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="Alpamayo 1.5 checkpoint directory")
    parser.add_argument("--backend", choices=BACKENDS, default="vllm")
    parser.add_argument("--device", default="cuda", help="torch device of the pipeline (cpu for tests)")
    parser.add_argument("--dtype", default=None, help="default: the checkpoint's model_dtype")
    parser.add_argument("--expert-quantization", default="none", choices=EXPERT_QUANTIZATIONS,
                        help="the action expert's weights: FP8 copies (fp8: kernel chosen for the GPU; "
                             "fp8_<kernel>: that one) or full precision")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    parser.add_argument("--model-name", default=ServerOptions.model_name, help="id in /v1/models and chat requests")
    parser.add_argument("--queue-size", type=int, default=ServerOptions.queue_size,
                        help="requests waiting for the pipeline before 503 + Retry-After")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20)
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="longest a request body may take to arrive; then 408 and the connection closes")
    parser.add_argument("--frame-store-frames", type=int, default=ServerOptions.frame_store_frames,
                        help="resized frames held for delta requests of /v1/plan (all clients)")
    parser.add_argument("--frame-store-mb", type=float, default=ServerOptions.frame_store_bytes / 2**20)
    parser.add_argument("--shm", action=argparse.BooleanOptionalAction, default=None,
                        help="take frames from clients' POSIX shared memory (/v1/plan, /predict); "
                             "default: only when --host is a loopback address")
    parser.add_argument("--max-samples", type=int, default=Limits.max_samples)
    parser.add_argument("--max-reasoning-tokens", type=int, default=Limits.max_reasoning_tokens)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM backend")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM backend: KV cache size")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vLLM backend: no CUDA graphs (decoder, vision tower) / compile")
    parser.add_argument("--max-model-len", type=int, default=8192, help="vLLM backend: longest prompt + reasoning")
    parser.add_argument("--speculation", choices=SPECULATION_METHODS, default="none",
                        help="vLLM backend: speculative reasoning (vllm.speculation.method of the node)")
    parser.add_argument("--speculation-draft-tokens", type=int, default=4, help="vLLM backend: tokens drafted per step")
    parser.add_argument("--speculation-proposer", choices=SPECULATION_PROPOSERS, default="auto",
                        help="vLLM backend: where --speculation plans looks drafts up (vllm.speculation.proposer of the node)")
    parser.add_argument("--cascade-attention", choices=CASCADE_MODES, default="off",
                        help="vLLM backend: samples attend to their shared prompt in one pass (vllm.cascade_attention of "
                             "the node)")
    parser.add_argument("--sidecar-settings", type=json.loads, default={},
                        help="JSON SamplingSettings fields for /predict (FlashDrive sidecar protocol), e.g. "
                             f"'{{\"flow_steps\": 8}}'; default {json.dumps(dataclasses.asdict(SIDECAR_SETTINGS))}")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    options = {}
    if args.backend == "vllm":
        options = {"kv_cache_gib": args.kv_cache_gib, "max_model_len": args.max_model_len}
        if args.device.startswith("cuda"):  # vLLM's CPU engine sizes memory by kv_cache_gib alone
            options["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.enforce_eager:
            options["enforce_eager"] = True
        if args.speculation != "none":
            options.update(speculation_method=args.speculation, speculation_draft_tokens=args.speculation_draft_tokens,
                           speculation_proposer=args.speculation_proposer)
        if args.cascade_attention != "off":
            options["cascade_attention"] = args.cascade_attention
    else:
        for flag, value in (("--speculation", args.speculation), ("--cascade-attention", args.cascade_attention)):
            if value not in ("none", "off"):
                logger.error("%s %s: needs --backend vllm, got %s", flag, value, args.backend)
                return 2

    def load() -> Pipeline:
        started = time.perf_counter()
        pipeline = Pipeline.from_checkpoint(args.checkpoint, backend=args.backend, device=args.device,
                                            dtype=args.dtype, backend_options=options,
                                            expert_quantization=args.expert_quantization)
        pipeline.warm_up(warmup_input(), WARMUP_SETTINGS)
        logger.info("ready: %s backend on %s, loaded and warmed up in %.1f s",
                    args.backend, args.device, time.perf_counter() - started)
        return pipeline

    if not args.body_timeout_s > 0:
        logger.error("--body-timeout-s: must be > 0, got %s", args.body_timeout_s)
        return 2
    limits = Limits(max_samples=args.max_samples, max_reasoning_tokens=args.max_reasoning_tokens)
    try:
        sidecar_settings = checked_settings(dataclasses.replace(SIDECAR_SETTINGS, **args.sidecar_settings), limits,
                                            prefix="--sidecar-settings ")
    except (TypeError, RequestError) as error:
        logger.error("--sidecar-settings: %s", error)
        return 2
    server_options = ServerOptions(
        model_name=args.model_name,
        api_key=args.api_key,
        queue_size=args.queue_size,
        max_body_bytes=int(args.max_body_mb * 2**20),
        limits=limits,
        default_settings=sidecar_settings,
        frame_store_frames=args.frame_store_frames,
        frame_store_bytes=int(args.frame_store_mb * 2**20),
        allow_shm=is_loopback(args.host) if args.shm is None else args.shm,
        body_timeout_s=args.body_timeout_s,
    )
    app = create_app(PipelineWorker(load, args.queue_size), server_options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
