"""Preprocessed camera frames, kept across plans so each frame is preprocessed once.

Consecutive plans see overlapping windows (4 frames per camera, one new per camera at a
10 Hz plan rate), so most of a plan's frames were already resized for the previous plan.
Each frame gets a key (camera, capture stamp, content fingerprint); the key also names the
image to the backend, whose own caches (vLLM's vision-encoder cache) then encode a frame
once as well.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from .frame_key import frame_key
from .preprocess import PreprocessedImages, VisionGeometry, resize_nhwc
from .types import DrivingInput


#: Threads that fingerprint a request's frames side by side (BLAKE3 releases the GIL): half the
#: cores, at most 8, so the pipeline's own threads keep theirs; 1 (serial) on small machines.
_HASH_THREADS = min(8, (os.cpu_count() or 1) // 2)
#: Below this many bytes per request, threads cost more than they save (~1 ms of hashing).
_PARALLEL_HASH_BYTES = 8 * 2**20


@lru_cache(maxsize=1)
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="frame-hash")


def frame_keys(inputs: DrivingInput) -> list[str]:
    """frame_key of every frame of inputs, camera-major then oldest first: the keys it carries
    (DrivingInput.with_frame_keys), else hashed here (16 full-HD frames are ~100 MB to hash: on
    several threads where the machine has the cores)."""
    if inputs.frame_keys is not None and not inputs.images.flags.writeable:  # writable (unpickled): maybe stale
        return list(inputs.frame_keys)
    slots = [
        (camera, int(stamp), image)
        for camera, stamps, row in zip(inputs.camera_indices, inputs.frame_stamps_ns, inputs.images)
        for stamp, image in zip(stamps, row)
    ]
    if _HASH_THREADS < 2 or inputs.images.nbytes < _PARALLEL_HASH_BYTES:
        return [frame_key(*slot) for slot in slots]
    return list(_hash_pool().map(lambda slot: frame_key(*slot), slots))


def _as_tensor(frames: np.ndarray) -> torch.Tensor:
    """frames as a CPU tensor on the same memory (one copy if not contiguous), only ever read. Through
    DLPack, which takes read-only arrays (keyed frames are) without torch.from_numpy's warning."""
    return torch.from_dlpack(np.ascontiguousarray(frames))


class FrameCache:
    """Least-recently-used resized frames (uint8 (3, h, w) each), where the backend wants them.

    Frames are resized on `compute_device` (the GPU when there is one) and stored on
    `store_device` (the backend's pixel_device: the GPU for HF; host memory for vLLM, which
    uploads only the frames it has to encode). Stored frames stay uint8: the backend makes
    the 4-8x larger patches itself, right before its vision tower.
    capacity: frames kept; 0 keeps nothing (every plan preprocesses all its frames).
    """

    def __init__(
        self, geometry: VisionGeometry, *, compute_device: torch.device, store_device: torch.device, capacity: int
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {capacity}")
        self.geometry = geometry
        self.compute_device = compute_device
        self.store_device = store_device
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # key -> resized uint8 (3, h, w)

    def __len__(self) -> int:
        return len(self._entries)

    def preprocess(self, frames: np.ndarray | Sequence[np.ndarray], keys: Sequence[str]) -> PreprocessedImages:
        """uint8 frames (N, H, W, 3) (or N frames (H, W, 3) of one size) named by keys, resized;
        only unseen ones are computed."""
        if len(keys) != len(frames):
            raise ValueError(f"keys: {len(keys)} keys for {len(frames)} frames")
        if len(set(keys)) != len(keys):
            raise ValueError("keys: the same frame key twice in one request")
        missing = [i for i, key in enumerate(keys) if key not in self._entries]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        fresh: dict[str, torch.Tensor] = {}
        if missing:
            resized = self._resize(frames, missing).to(self.store_device, memory_format=torch.contiguous_format)
            fresh = dict(zip([keys[i] for i in missing], resized))
        result = PreprocessedImages(
            frames=self._stack([fresh[key] if key in fresh else self._entries[key] for key in keys]),
            geometry=self.geometry,
            keys=tuple(keys),
        )
        self._remember(keys, fresh)
        return result

    def resize(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 frames (N, H, W, 3) resized on the compute device as preprocess() resizes them:
        uint8 (N, 3, h, w) there (channels-last on the CPU), not cached yet. For callers that need
        the resized pixels themselves before planning (alpamayo-serve's frame store keeps the
        frames shared-memory clients sent); remember() then keeps them for the plan."""
        return self._resize(frames, list(range(len(frames))))

    def remember(self, keys: Sequence[str], frames: torch.Tensor) -> None:
        """Keep resized uint8 frames (N, 3, h, w), as resize() returns them, under keys, as if
        preprocess() had made them: a later preprocess() of these keys resizes nothing."""
        if len(keys) != len(frames):
            raise ValueError(f"keys: {len(keys)} keys for {len(frames)} frames")
        stored = frames.to(self.store_device, memory_format=torch.contiguous_format)
        self._remember(keys, dict(zip(keys, stored)))

    def host_buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised uint8 host array to fill and hand back to this cache. Next to a GPU it
        is pinned, from torch's caching host allocator: once warm, filling it costs no page faults
        and its upload runs at full bus speed (alpamayo-serve reads shared-memory frames into it)."""
        if self.compute_device.type != "cuda":
            return np.empty(shape, dtype=np.uint8)
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()

    def _stack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """All frames of a request in one tensor. Host-side next to a GPU, in pinned memory:
        its allocator reuses blocks (no page faults per plan) and the backend's upload of the
        frames it encodes runs at full bus speed."""
        if not (self.store_device.type == "cpu" and self.compute_device.type == "cuda"):
            return torch.stack(parts)
        out = torch.empty((len(parts), *parts[0].shape), dtype=parts[0].dtype, pin_memory=True)
        return torch.stack(parts, out=out)

    def _resize(self, frames: np.ndarray | Sequence[np.ndarray], indices: list[int]) -> torch.Tensor:
        """frames[indices] resized on the compute device, uint8 (n, 3, h, w). On the CPU each frame
        is resized from a view of its own: no gathered copy of the capture-size frames."""
        if self.compute_device.type != "cpu":
            return resize_nhwc(self._upload(frames, indices), self.geometry)
        views = [_as_tensor(frames[index])[None] for index in indices]
        return torch.cat([resize_nhwc(view, self.geometry) for view in views])

    def _upload(self, frames: np.ndarray | Sequence[np.ndarray], indices: list[int]) -> torch.Tensor:
        """frames[indices] as one uint8 (n, H, W, 3) batch on the compute device, without a
        host-side gather."""
        if len(indices) == len(frames) and isinstance(frames, np.ndarray):
            return _as_tensor(frames).to(self.compute_device)
        shape = frames[indices[0]].shape
        batch = torch.empty((len(indices), *shape), dtype=torch.uint8, device=self.compute_device)
        for row, index in enumerate(indices):
            batch[row].copy_(_as_tensor(frames[index]))
        return batch

    def _remember(self, keys: Sequence[str], fresh: dict[str, torch.Tensor]) -> None:
        if self.capacity == 0:
            return
        for key in keys:
            if key in fresh:
                self._entries[key] = fresh[key]
            self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
