"""Validating a binary plan request (wire.PlanRequest) into what the pipeline plans.

A request is checked whole before anything of it is kept: a delta's new frames enter the frame
store only once every field is valid. Frames from a client's shared memory arrive at capture
size; they are copied out here (the client may reuse its segment once answered) and resized
later, in the pipeline's job, by the pipeline's own frame cache on its device: the same code and
device as in-process planning, so the plan is the same, and the client's CPU does no resizing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..core.frame_cache import FrameCache
from ..core.frame_key import keyed_frame
from ..core.preprocess import VisionGeometry, smart_resize
from ..core.types import DrivingInput, SamplingSettings
from . import wire
from .frame_store import FrameKey, FrameStore
from .requests import Limits, RequestError, checked_cameras, checked_settings, driving_input
from .shm import PLAN_SEGMENT, read_segment

_SESSION = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class CaptureSizeFrames:
    """A shared-memory delta's new frames, not yet resized, and where they go once they are.

    frames: uint8 (n, H, W, 3), copied out of the client's segment.
    slots: their slots in the window; keys: their frame-store keys (camera, stamp, size).
    window: uint8 (cameras * frames, h, w, 3), the request's DrivingInput.images (flat): its
        slots hold the referenced frames, and these frames once resize_into() ran.
    held: the frame key of each window slot held before (None at this delta's slots).
    read_ms: how long copying them out of the segment took.
    """

    frames: np.ndarray
    slots: list[int]
    keys: list[FrameKey]
    window: np.ndarray
    held: list[str | None]
    read_ms: float

    def resize_into(self, cache: FrameCache, store: FrameStore, inputs: DrivingInput) -> DrivingInput:
        """inputs (whose images are the window) with these frames resized into their slots and
        every frame's key. Resized on the cache's device (as the pipeline resizes), copied
        straight into the window's slots (from a GPU: one transpose there, then into the pinned
        window), stored keyed, and handed to the cache under those keys: the plan then resizes and
        hashes nothing again (no second upload, transpose and download of these frames)."""
        resized = cache.resize(self.frames)  # (n, 3, h, w) on the cache's compute device
        window = torch.from_numpy(self.window)
        for row, slot in enumerate(self.slots):
            window[slot].copy_(resized[row].permute(1, 2, 0))
        keyed = {key: keyed_frame(key.camera, key.stamp_ns, self.window[slot]) for key, slot in zip(self.keys, self.slots)}
        store.put(keyed)
        cache.remember([frame.key for frame in keyed.values()], resized)
        keys = list(self.held)
        for key, slot in zip(self.keys, self.slots):
            keys[slot] = keyed[key].key
        return inputs.with_frame_keys(keys)


def parse_plan_request(
    body: bytes, limits: Limits, store: FrameStore, frames: FrameCache, allow_shm: bool
) -> tuple[DrivingInput, SamplingSettings, CaptureSizeFrames | None]:
    """Decode and validate a binary plan request for the pipeline whose frame cache is frames.
    Inline delta frames are stored here, and a delta's input carries its frames' keys; frames
    from shared memory come back to be resized on the pipeline's device (None when there are
    none), and their resize_into() gives the keyed input."""
    try:
        request = wire.decode_request(body)
        arrays = {
            "frame_stamps_ns": wire.unpack_array("frame_stamps_ns", request.frame_stamps_ns, np.int64, 2),
            "ego_history_xyz": wire.unpack_array("ego_history_xyz", request.ego_history_xyz, np.float32, 2),
            "ego_history_rot": wire.unpack_array("ego_history_rot", request.ego_history_rot, np.float32, 3),
        }
        images = None if request.images is None else wire.unpack_array("images", request.images, np.uint8, 5)
        sent = None if request.sent is None else wire.unpack_array("sent", request.sent, np.uint8, 4)
    except wire.WireError as failure:
        raise RequestError(failure.field, str(failure).split(": ", 1)[-1]) from failure
    settings = checked_settings(SamplingSettings(**{name: getattr(request.settings, name)
                                                    for name in wire.Settings.__struct_fields__}), limits)
    held: list[str | None] = []
    sent_keys: dict[int, FrameKey] = {}
    pending = None
    if request.session is None:
        if images is None:
            raise RequestError("images", "required (or a delta request: session, frame_size, sent or shm, sent_slots)")
        if request.frame_size is not None or sent is not None or request.shm is not None or request.sent_slots:
            raise RequestError("session", "required with frame_size, sent, shm and sent_slots (a delta request)")
    elif images is not None:
        raise RequestError("images", "a delta request (with a session) carries its frames in sent or shm, not images")
    else:
        images, held, sent_keys, pending = _delta_window(request, sent, arrays["frame_stamps_ns"], limits, store,
                                                         frames, allow_shm)
    inputs = driving_input(images=images, camera_indices=tuple(request.camera_indices), t0_ns=request.t0_ns,
                           route_text=request.route_text, limits=limits, **arrays)
    if request.session is not None and pending is None:  # keyed only once the whole request is valid
        window = images.reshape(-1, *images.shape[2:])
        new = {key: keyed_frame(key.camera, key.stamp_ns, window[slot]) for slot, key in sent_keys.items()}
        for slot, key in sent_keys.items():
            held[slot] = new[key].key
        store.put(new)
        inputs = inputs.with_frame_keys(held)
    return inputs, settings, pending


def _delta_window(
    request: wire.PlanRequest, sent: np.ndarray | None, stamps: np.ndarray, limits: Limits, store: FrameStore,
    frames: FrameCache, allow_shm: bool,
) -> tuple[np.ndarray, list[str | None], dict[int, FrameKey], CaptureSizeFrames | None]:
    """The (cameras, frames, h, w, 3) window of a delta request: every referenced slot from the
    store (409 naming what is missing) and the sent frames in theirs; the frame key of each
    referenced slot (None at the sent ones); the sent slots' store keys. For frames in shared
    memory, their slots stay empty, with the frames to resize into them. Both the shared-memory
    frames and the window land in the frame cache's host buffers."""
    geometry = frames.geometry
    session = request.session or ""
    if not _SESSION.fullmatch(session):
        raise RequestError("session", f"expected 1-64 characters of A-Z a-z 0-9 _ -, got {session[:80]!r}")
    if request.frame_size is None or len(request.frame_size) != 2:
        raise RequestError("frame_size", f"expected [height, width], got {request.frame_size!r}")
    height, width = request.frame_size
    try:
        valid = smart_resize(height, width, geometry) == (height, width)
    except ValueError:
        valid = False
    if not valid:
        raise RequestError("frame_size", f"{height}x{width} is not a size this server resizes frames to "
                                         "(send frames resized for the geometry of GET /v1/plan/info)")
    if (sent is None) == (request.shm is None):
        raise RequestError("sent", "a delta request carries its new frames in sent or in shm, exactly one of "
                                   "them (sent may hold no frames)")
    if sent is not None and sent.shape[1:] != (height, width, 3):
        raise RequestError("sent", f"expected frames of shape ({height}, {width}, 3) (frame_size), got {sent.shape[1:]}")
    shape = sent.shape if sent is not None else _checked_shm(request.shm, (height, width), geometry, limits, allow_shm)
    cameras, count = stamps.shape
    if cameras != len(request.camera_indices):
        raise RequestError("frame_stamps_ns", f"{cameras} rows of stamps for {len(request.camera_indices)} cameras")
    if not 0 < cameras * count <= limits.max_images:
        raise RequestError("frame_stamps_ns", f"{cameras * count} frames (expected 1 to {limits.max_images})")
    checked_cameras(request.camera_indices)
    slots = request.sent_slots
    if len(slots) != shape[0]:
        raise RequestError("sent_slots", f"{len(slots)} slots for {shape[0]} sent frames")
    if len(set(slots)) != len(slots) or any(not 0 <= slot < cameras * count for slot in slots):
        raise RequestError("sent_slots", f"expected distinct slots in [0, {cameras * count}), got {slots}")
    if sent is None:  # copied out before the store is asked: a bad reference is a 4xx, not a 409
        nbytes = int(np.prod(shape, dtype=np.int64))
        read_started = time.perf_counter()
        captured = read_segment("shm", request.shm.name, PLAN_SEGMENT, request.shm.offset, nbytes,
                                out=frames.host_buffer((nbytes,))).reshape(shape)
        read_ms = (time.perf_counter() - read_started) * 1e3
    keys = [FrameKey(session, request.camera_indices[slot // count], int(stamps[slot // count, slot % count]),
                     height, width) for slot in range(cameras * count)]
    window = frames.host_buffer((cameras * count, height, width, 3))
    referenced = sorted(set(range(cameras * count)) - set(slots))
    found, missing = store.take(keys[slot] for slot in referenced)
    if missing:
        named = ", ".join(f"camera {key.camera} stamp {key.stamp_ns}" for key in missing[:8])
        raise RequestError("sent_slots", f"{len(missing)} referenced frames are not held for this session ({named}); "
                           "send them in sent", 409, "frames_missing")
    held: list[str | None] = [None] * (cameras * count)
    for slot in referenced:
        window[slot] = found[keys[slot]].image
        held[slot] = found[keys[slot]].key
    framed = window.reshape(cameras, count, height, width, 3)
    if sent is not None:
        window[slots] = sent
        return framed, held, {slot: keys[slot] for slot in slots}, None
    pending = None
    if slots:
        pending = CaptureSizeFrames(captured, slots, [keys[slot] for slot in slots], window, held, read_ms)
    return framed, held, {}, pending


def _checked_shm(shm: wire.ShmFrames, frame_size: tuple[int, int], geometry: VisionGeometry, limits: Limits,
                 allow_shm: bool) -> tuple[int, int, int, int]:
    """The (n, H, W, 3) shape of a delta's frames in shared memory, once the reference is one
    this server takes: shm allowed, uint8, frames that resize to frame_size."""
    if not allow_shm:
        raise RequestError("shm", "this server takes no shared-memory frames (it does for a loopback bind or "
                                  "with --shm); send them in sent", 403, "shm_unavailable")
    try:
        dtype = np.dtype(shm.dtype)
    except TypeError as error:
        raise RequestError("shm.dtype", f"unknown dtype {shm.dtype!r}") from error
    if dtype != np.uint8:
        raise RequestError("shm.dtype", f"expected uint8, got {dtype.name}")
    shape = tuple(shm.shape)
    if len(shape) != 4 or shape[3] != 3 or any(side < 0 for side in shape):
        raise RequestError("shm.shape", f"expected (frames, height, width, 3), got {list(shape)}")
    if shape[1] * shape[2] > limits.max_image_pixels:
        raise RequestError("shm.shape", f"{shape[2]}x{shape[1]} pixels per frame (limit {limits.max_image_pixels})")
    try:
        resized = smart_resize(shape[1], shape[2], geometry)
    except ValueError as error:
        raise RequestError("shm.shape", str(error)) from error
    if resized != tuple(frame_size):
        raise RequestError("shm.shape", f"{shape[1]}x{shape[2]} frames resize to {resized[0]}x{resized[1]}, "
                                        f"not frame_size {frame_size[0]}x{frame_size[1]}")
    return shape
