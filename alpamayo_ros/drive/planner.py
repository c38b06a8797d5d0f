"""Where the drive node's plans come from: one factory from settings to a Planner.

The inference worker only knows this protocol: the in-process model (model.backend hf or vllm)
and an alpamayo-serve server (model.backend remote) are interchangeable behind it.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Protocol

import numpy as np

from alpamayo_ros.core.types import DrivingInput, Plan, PlanCancelled, SamplingSettings
from alpamayo_ros.settings import DriveSettings, RemoteSettings

logger = logging.getLogger(__name__)

WARMUP_SIZE = (576, 320)  # (width, height) of warm-up frames when images.* keep native size


class Planner(Protocol):
    """Plans one input at a time; cancel() may be called from any thread."""

    def plan(self, driving_input: DrivingInput, sampling: SamplingSettings) -> Plan:
        """One plan; raises PlanCancelled once cancel() was called, PlanUnavailable when a fault
        outside the input and the model (a remote server) left this one unplanned."""

    def warm_up(self, driving_input: DrivingInput, sampling: SamplingSettings) -> None:
        """Run what the first real plan would otherwise pay for (allocations, compilation)."""

    def cancel(self) -> None:
        """Stop the plan in flight at its next step, and refuse later ones (shutdown)."""

    def close(self) -> None:
        """Release the model (call from the thread that planned: vLLM frees GPU memory there)."""


class PlanUnavailable(RuntimeError):
    """No plan for a reason that is not the input's (the server is down, too slow or refused).

    reason is the diagnostic key (remote_unavailable, remote_timeout, remote_rejected); the
    planner stays usable and the next input may well be planned.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PipelinePlanner:
    """The in-process model (hf or vllm backend)."""

    def __init__(self, settings: DriveSettings) -> None:
        from alpamayo_ros.core.pipeline import Pipeline  # torch is imported here, not by the ROS layer

        self._pipeline = Pipeline.from_checkpoint(
            settings.checkpoint_path, backend=settings.backend, device=settings.device,
            dtype=settings.dtype, backend_options=settings.backend_options,
            expert_quantization=settings.expert_quantization,
        )  # fmt: skip

    def plan(self, driving_input: DrivingInput, sampling: SamplingSettings) -> Plan:
        return self._pipeline.plan(driving_input, sampling)

    def warm_up(self, driving_input: DrivingInput, sampling: SamplingSettings) -> None:
        self._pipeline.warm_up(driving_input, sampling)

    def cancel(self) -> None:
        self._pipeline.cancel()

    def close(self) -> None:
        self._pipeline.close()


class ServerPlanner:
    """Plans on an alpamayo-serve server (model.backend remote); needs no model here.

    Construction and warm-up never wait for the server: a server that is down or still loading
    leaves the node ready, and every plan until it answers raises PlanUnavailable (the client
    backs off between connection attempts, so a dead server costs a tick next to nothing).
    """

    def __init__(self, remote: RemoteSettings) -> None:
        from alpamayo_ros.serve.client import RemotePlanner  # httpx and torch: not for the ROS layer

        self._client = RemotePlanner(remote.url, timeout_s=remote.timeout_s, api_key=remote.api_key or None,
                                     frame_transport=remote.frame_transport)
        self._cancelled = threading.Event()

    def plan(self, driving_input: DrivingInput, sampling: SamplingSettings) -> Plan:
        from alpamayo_ros.serve.client import RemoteError

        if self._cancelled.is_set():
            raise PlanCancelled("planner cancelled")
        try:
            plan = self._client.plan(driving_input, sampling)
        except RemoteError as error:
            if self._cancelled.is_set():
                raise PlanCancelled("planner cancelled") from error
            raise PlanUnavailable(error.reason, str(error)) from error
        if self._cancelled.is_set():  # an answer that arrived after cancel() is not published
            raise PlanCancelled("planner cancelled")
        return plan

    def warm_up(self, driving_input: DrivingInput, sampling: SamplingSettings) -> None:
        """One plan (the client learns the server's frame geometry); a server that does not
        answer yet is logged, not fatal."""
        try:
            self.plan(driving_input, sampling)
        except PlanUnavailable as error:
            logger.warning(f"warm-up plan on {self._client.url}: {error}; planning starts when the server answers")

    def cancel(self) -> None:
        """Refuse later plans; one in flight ends within remote.timeout_s and is discarded."""
        self._cancelled.set()

    def close(self) -> None:
        self._client.close()


#: modules a model load imports, per backend (the import, not the weights, holds the GIL for long)
MODEL_STACK = {
    "hf": ("alpamayo_ros.core.pipeline", "alpamayo_ros.core.backbone_hf", "transformers.models.qwen3_vl.modeling_qwen3_vl"),
    # not vllm itself: the backend sets its in-process switch before vLLM is first imported
    "vllm": ("alpamayo_ros.core.pipeline", "alpamayo_ros.core.backbone_vllm"),
    "remote": ("alpamayo_ros.serve.client",),  # httpx, torch (the client resizes frames)
}


def import_model_stack(settings: DriveSettings) -> None:
    """Import what make_planner(settings) will need, so the load itself imports little."""
    for module in MODEL_STACK.get(settings.backend, ()):
        importlib.import_module(module)


def make_planner(settings: DriveSettings) -> Planner:
    """The planner model.backend asks for (slow for hf and vllm: loads the model)."""
    if settings.remote is not None:
        return ServerPlanner(settings.remote)
    return PipelinePlanner(settings)


def warmup_input(settings: DriveSettings) -> DrivingInput:
    """A plausible synthetic input (straight drive at 5 m/s) in the configured layout."""
    sync, history = settings.frame_sync, settings.ego_history
    width, height = settings.image_size or WARMUP_SIZE
    cameras = len(sync.camera_indices)
    poses = history.num_poses
    xyz = np.zeros((poses, 3), dtype=np.float32)
    xyz[:, 0] = -5.0 * history.dt_ns / 1e9 * np.arange(poses - 1, -1, -1)
    stamps = np.arange(sync.frames_per_camera, dtype=np.int64) * sync.frame_spacing_ns
    return DrivingInput(
        images=np.full((cameras, sync.frames_per_camera, height, width, 3), 128, dtype=np.uint8),
        camera_indices=sync.camera_indices,
        frame_stamps_ns=np.tile(stamps, (cameras, 1)),
        t0_ns=int(stamps[-1]),
        ego_history_xyz=xyz,
        ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (poses, 1, 1)),
    )
