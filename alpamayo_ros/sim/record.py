"""Session recording: every drive() as a JSON line, every plan's input and answer as an .npz.

    DIR/<session>/drives.jsonl    tick, time_now_us, outcome, handler_ms, plan_ms, reasoning, ...
    DIR/<session>/plan_<tick>.npz the DrivingInput's arrays, the seed, the t0 pose, the response bytes

An .npz holds what it takes to plan that tick again with Pipeline.plan and compare, so a
recorded session can be checked against the in-process model (the tests do).
"""

from __future__ import annotations

import json
import pickle
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
from carla_driver_interface.protocol import DriveRequest, DriveResponse

from alpamayo_ros.core.types import DrivingInput
from alpamayo_ros.drive.loop import Planned
from alpamayo_ros.sim.session import Drive


class SessionRecorder:
    """A DriveObserver (EgodriverService's on_drive) writing under one directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._ticks: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, session: str, request: DriveRequest, drive: Drive, handler_ms: float) -> None:
        with self._lock:
            tick = self._ticks[session]
            self._ticks[session] += 1
        folder = self.root / session
        folder.mkdir(exist_ok=True)
        debug = pickle.loads(drive.response.debug_info.unstructured_debug_info)
        line = {"tick": tick, "time_now_us": drive.now_us, "time_query_us": int(request.time_query_us),
                "handler_ms": handler_ms, "poses": len(drive.response.trajectory.poses), **debug}  # fmt: skip
        outcome = drive.step.outcome
        if isinstance(outcome, Planned):
            line["outcome"] = "planned"
            write_plan(folder / f"plan_{tick:05d}.npz", outcome, drive.step.seed, drive.response)
        else:
            line["outcome"] = outcome.reason
        with open(folder / "drives.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")


def write_plan(path: Path, planned: Planned, seed: int, response: DriveResponse) -> None:
    i, ego = planned.request.assembly.driving_input, planned.request.assembly.ego
    np.savez_compressed(
        path, images=i.images, camera_indices=np.array(i.camera_indices), frame_stamps_ns=i.frame_stamps_ns,
        t0_ns=np.int64(i.t0_ns), ego_history_xyz=i.ego_history_xyz, ego_history_rot=i.ego_history_rot,
        route_text=np.array(i.route_text or ""), xyz_t0=ego.xyz_t0, rot_t0=ego.rot_t0,
        seed=np.uint64(seed), response=np.frombuffer(response.SerializeToString(), dtype=np.uint8),
    )  # fmt: skip


def read_plan(path: str | Path) -> tuple[DrivingInput, dict[str, np.ndarray], DriveResponse]:
    """(the input, {seed, xyz_t0, rot_t0}, the response as sent) of one recorded plan."""
    with np.load(path) as data:
        driving_input = DrivingInput(
            images=data["images"], camera_indices=tuple(int(c) for c in data["camera_indices"]),
            frame_stamps_ns=data["frame_stamps_ns"], t0_ns=int(data["t0_ns"]), ego_history_xyz=data["ego_history_xyz"],
            ego_history_rot=data["ego_history_rot"], route_text=str(data["route_text"]) or None,
        )  # fmt: skip
        pose = {"seed": int(data["seed"]), "xyz_t0": data["xyz_t0"], "rot_t0": data["rot_t0"]}
        response = DriveResponse.FromString(data["response"].tobytes())
    return driving_input, pose, response
