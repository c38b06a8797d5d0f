"""drive() through alpamayo-egodriver against Pipeline.plan in this process, on the same frames.

A client plays AlpaSim's runtime for one session: each 0.1 s step it submits the egomotion pose
and one JPEG frame per camera (road scenes rendered by carla-driver-interface, as AlpaSim
renders and encodes them), then times drive() from call to answer (gRPC, JPEG decoding, the
drive loop's assembly, planning, the answer's conversion). The same decoded frames, stamps and
history then go to Pipeline.plan in this process, timed the same way. The service runs first and
is stopped before the in-process model loads, so the two never share the device.

    python -m bench.bench_egodriver --smoke
    python -m bench.bench_egodriver --workload W16 --checkpoint /tmp/ckpt --device cuda --backend vllm --runs 50
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from carla_driver_interface.geometry import Pose
from carla_driver_interface.protocol import (DriveRequest, DriveSessionCloseRequest, DriveSessionRequest,
                                             EgodriverServiceStub, RolloutCameraImage, RolloutEgoTrajectory,
                                             channel_options)  # fmt: skip
from carla_driver_interface.testing import FakeCamera, render_road
from PIL import Image

from alpamayo_ros.core.types import NUM_HISTORY_POSES, DrivingInput, SamplingSettings
from alpamayo_ros.drive.loop import decode_image
from alpamayo_ros.drive.messages import CompressedImage
from alpamayo_ros.settings import SPECS, sampling_settings
from alpamayo_ros.sim.cli import ALPASIM_CAMERAS
from alpamayo_ros.sim.process import start_egodriver
from bench.bench_pipeline import WORKLOADS, Workload, percentiles

logger = logging.getLogger("bench_egodriver")

STEP_US = 100_000
SPEED_MPS = 10.0
HISTORY_STEPS = NUM_HISTORY_POSES - 1  # drive() calls before the history reaches back 1.5 s
DISTINCT_FRAMES = 8  # rendered once per camera and cycled (stamps keep every frame new to the caches)
VIEWS = {0: (60.0, 120.0), 1: (0.0, 120.0), 2: (-60.0, 120.0), 6: (0.0, 30.0)}  # index -> (yaw left, fov) deg


class Frames:
    """Per camera, DISTINCT_FRAMES road renders as JPEG bytes and as the RGB the service decodes."""

    def __init__(self, workload: Workload) -> None:
        ids = {index: name for name, index in ALPASIM_CAMERAS.items()}
        self.cameras = [FakeCamera(logical_id=ids[index], width=workload.width, height=workload.height,
                                   fov_deg=VIEWS[index][1], yaw_left_deg=VIEWS[index][0], pitch_down_deg=5.0)
                        for index in workload.cameras]  # fmt: skip
        self.indices = workload.cameras
        self.jpeg: dict[tuple[int, int], bytes] = {}
        self.rgb: dict[tuple[int, int], np.ndarray] = {}
        for k in range(DISTINCT_FRAMES):
            for index, camera in zip(self.indices, self.cameras):
                buffer = io.BytesIO()
                Image.fromarray(render_road(camera, ego_pose(k))).save(buffer, format="JPEG", quality=90)
                self.jpeg[index, k] = buffer.getvalue()
                self.rgb[index, k] = decode_image(CompressedImage("jpeg", self.jpeg[index, k]), None)

    def at(self, index: int, step: int) -> tuple[bytes, np.ndarray]:
        key = (index, step % DISTINCT_FRAMES)
        return self.jpeg[key], self.rgb[key]


def ego_pose(step: int) -> Pose:
    return Pose.from_xyz_yaw(SPEED_MPS * step * STEP_US / 1e6, 0.0, 0.0, 0.0)


def bench_service(frames: Frames, args: argparse.Namespace, params: dict[str, object], steps: int) -> list[float]:
    """drive() milliseconds of the steps after the history fills and the warm-up."""
    service_args = ["--checkpoint", args.checkpoint, "--device", args.device, "--backend", args.backend,
                    *[a for c, i in zip(frames.cameras, frames.indices) for a in ("--camera", f"{c.logical_id}={i}")],
                    *[a for name, value in params.items() for a in ("-p", f"{name}={value}")]]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    service = start_egodriver(service_args, env=env, timeout_s=1800.0)
    timings: list[float] = []
    try:
        with grpc.insecure_channel(service.address, options=channel_options()) as channel:
            stub = EgodriverServiceStub(channel)
            request = DriveSessionRequest(session_uuid="bench", random_seed=0)
            request.rollout_spec.vehicle.available_cameras.extend(c.available_camera() for c in frames.cameras)
            stub.start_session(request)
            for k in range(steps):
                now_us = k * STEP_US
                egomotion = RolloutEgoTrajectory(session_uuid="bench")
                egomotion.trajectory.poses.append(ego_pose(k).to_proto_at_time(now_us))
                stub.submit_egomotion_observation(egomotion)
                for index, camera in zip(frames.indices, frames.cameras):
                    image = RolloutCameraImage(session_uuid="bench")
                    image.camera_image.logical_id = camera.logical_id
                    image.camera_image.frame_start_us = image.camera_image.frame_end_us = now_us
                    image.camera_image.image_bytes = frames.at(index, k)[0]
                    stub.submit_image_observation(image)
                started = time.perf_counter()
                answer = stub.drive(DriveRequest(session_uuid="bench", time_now_us=now_us, time_query_us=now_us + STEP_US))
                elapsed_ms = (time.perf_counter() - started) * 1e3
                if k >= HISTORY_STEPS:
                    if not answer.trajectory.poses:
                        raise RuntimeError(f"step {k}: the service answered no plan once the history sufficed")
                    timings.append(elapsed_ms)
            stub.close_session(DriveSessionCloseRequest(session_uuid="bench"))
    finally:
        service.stop()
    return timings[args.warmup:]


def bench_in_process(frames: Frames, args: argparse.Namespace, sampling: SamplingSettings, steps: int,
                     workload: Workload) -> list[float]:  # fmt: skip
    """Pipeline.plan milliseconds on the windows the service planned (same frames, stamps, history)."""
    import torch

    from alpamayo_ros.core.pipeline import Pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    pipeline = Pipeline.from_checkpoint(args.checkpoint, backend=args.backend, device=args.device)
    history = np.zeros((NUM_HISTORY_POSES, 3), dtype=np.float32)
    history[:, 0] = -SPEED_MPS * STEP_US / 1e6 * np.arange(NUM_HISTORY_POSES - 1, -1, -1)
    rotations = np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1))
    timings: list[float] = []
    try:
        for k in (HISTORY_STEPS, *range(HISTORY_STEPS, steps)):  # the first once more: the service's warm-up
            window = range(k - workload.frames + 1, k + 1)
            driving_input = DrivingInput(
                images=np.stack([np.stack([frames.at(i, j)[1] for j in window]) for i in frames.indices]),
                camera_indices=tuple(frames.indices),
                frame_stamps_ns=np.array([[j * STEP_US * 1000 for j in window]] * len(frames.indices), dtype=np.int64),
                t0_ns=k * STEP_US * 1000, ego_history_xyz=history, ego_history_rot=rotations,
            )  # fmt: skip
            started = time.perf_counter()
            pipeline.plan(driving_input, sampling)
            timings.append((time.perf_counter() - started) * 1e3)
    finally:
        pipeline.close()
    return timings[1 + args.warmup:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random checkpoint, small frames, on the CPU")
    parser.add_argument("--workload", default="W16", help=f"one of {sorted(WORKLOADS)}")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (--smoke writes a tiny one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="vllm", choices=("hf", "vllm"))
    parser.add_argument("--runs", type=int, default=30, help="timed drive() calls and plans")
    parser.add_argument("--warmup", type=int, default=3, help="untimed plans after the history fills")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads on both sides (0: as the environment says; --smoke: 1, since the "
                             "service plans in gRPC handler threads)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

        args.workload, args.device, args.backend = "smoke", "cpu", "hf"
        args.runs, args.warmup, args.threads = min(args.runs, 4), min(args.warmup, 1), args.threads or 1
        args.checkpoint = args.checkpoint or str(write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-ego-")), seed=0))
    if args.checkpoint is None:
        parser.error("--checkpoint: required without --smoke")
    workload = WORKLOADS[args.workload]
    params = {"sampling.num_samples": workload.samples, "sampling.temperature": 0.0,
              "sampling.max_reasoning_tokens": workload.reasoning_tokens}  # fmt: skip
    sampling = sampling_settings({**{name: spec.default for name, spec in SPECS.items()}, **params})  # the service's
    steps = HISTORY_STEPS + args.warmup + args.runs
    frames = Frames(workload)
    service_ms = bench_service(frames, args, params, steps)
    in_process_ms = bench_in_process(frames, args, sampling, steps, workload)
    service, in_process = percentiles(service_ms), percentiles(in_process_ms)
    result = {"workload": args.workload, "device": args.device, "backend": args.backend, "runs": len(service_ms),
              "threads": args.threads or "environment",
              "drive_ms": service, "plan_ms": in_process,
              "overhead_ms": {q: service[q] - in_process[q] for q in ("p50", "p90")}}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
