"""The FlashDrive sidecar protocol of Autoware's Alpamayo node (autowarefoundation/alpamayo-autoware,
`alpamayo_ros/flashdrive_sidecar`), so that node can plan with alpamayo-serve unmodified.

Facts of that protocol (from its wire.py, server.py and node client):
- body: 4-byte big-endian header length, a UTF-8 JSON header {"meta": {...}, "arrays": [{key,
  dtype, shape, nbytes[, shm]}]}, then the inline arrays' bytes in header order;
- an array with "shm" lives in a POSIX shared-memory segment of that name (their client names
  them fdw_<32 hex>, writes, and unlinks after the reply; the server only reads);
- POST /predict: meta {num_frames_per_camera, nav_text}, arrays image_frames uint8 (cams, frames,
  3, H, W), camera_indices int64 (cams), ego_history_xyz float32 (1, 1, 16, 3), ego_history_rot
  float32 (1, 1, 16, 3, 3); reply meta {status: "ok", cot, *_sec timings}, arrays traj_batch
  float32 (N, 64, 3), rot_batch float32 (N, 64, 3, 3); POST /reset; GET /health (200 when ready).
Their streaming sidecar answers window 0 with status "prefill"; we plan every window in full (their
client accepts "ok" on any window). The protocol carries no capture times, so frames are stamped
at 0.1 s spacing before the arrival time, and sampling follows the server's default settings.
Malformed requests get a 4xx whose body is a wire message {status: "error", message}.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from ..core.types import FRAME_SPACING_S, NUM_HISTORY_POSES, DrivingInput, Plan
from .requests import Limits, RequestError, driving_input
from .shm import SIDECAR_SEGMENT, read_segment

CONTENT_TYPE = "application/octet-stream"
_HEADER_LENGTH = struct.Struct(">I")
#: key -> (dtype, shape with None for free sides) of every array /predict accepts
PREDICT_ARRAYS: dict[str, tuple[np.dtype, tuple[int | None, ...]]] = {
    "image_frames": (np.dtype(np.uint8), (None, None, 3, None, None)),
    "camera_indices": (np.dtype(np.int64), (None,)),
    "ego_history_xyz": (np.dtype(np.float32), (1, 1, NUM_HISTORY_POSES, 3)),
    "ego_history_rot": (np.dtype(np.float32), (1, 1, NUM_HISTORY_POSES, 3, 3)),
}


def encode(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A wire message with every array inline."""
    blocks = [np.ascontiguousarray(array) for array in arrays.values()]
    descriptors = [
        {"key": key, "dtype": block.dtype.str, "shape": list(block.shape), "nbytes": block.nbytes}
        for key, block in zip(arrays, blocks)
    ]
    header = json.dumps({"meta": meta, "arrays": descriptors}).encode()
    return _HEADER_LENGTH.pack(len(header)) + header + b"".join(block.tobytes() for block in blocks)


def decode_predict(body: bytes, allow_shm: bool) -> tuple[dict, dict[str, np.ndarray]]:
    """Parse and check a /predict body: framing, the four arrays' dtypes and shapes, shm segments
    (refused unless allow_shm)."""
    if len(body) < _HEADER_LENGTH.size:
        raise RequestError("body", "shorter than the 4-byte header length")
    (length,) = _HEADER_LENGTH.unpack_from(body)
    if _HEADER_LENGTH.size + length > len(body):
        raise RequestError("body", f"header length {length} exceeds the body ({len(body)} bytes)")
    try:
        header = json.loads(body[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError("header", f"not JSON ({error})") from error
    if not isinstance(header, dict) or not isinstance(header.get("meta", {}), dict) or not isinstance(header.get("arrays"), list):
        raise RequestError("header", 'expected {"meta": {...}, "arrays": [...]}')
    offset = _HEADER_LENGTH.size + length
    arrays: dict[str, np.ndarray] = {}
    for position, descriptor in enumerate(header["arrays"]):
        key = descriptor.get("key") if isinstance(descriptor, dict) else None
        if key not in PREDICT_ARRAYS:
            raise RequestError(f"arrays[{position}].key", f"expected one of {sorted(PREDICT_ARRAYS)}, got {key!r}")
        if key in arrays:
            raise RequestError(key, "given twice")
        dtype, shape = _checked_descriptor(key, descriptor)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if "shm" in descriptor:
            if not allow_shm:
                raise RequestError(key, "this server takes no shared memory (--shm)", 403, "shm_unavailable")
            raw = read_segment(key, descriptor["shm"], SIDECAR_SEGMENT, 0, nbytes)
        else:
            raw = body[offset : offset + nbytes]
            if len(raw) != nbytes:
                raise RequestError(key, f"body ends {nbytes - len(raw)} bytes early")
            offset += nbytes
        arrays[key] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if offset != len(body):
        raise RequestError("body", f"{len(body) - offset} bytes after the last array")
    missing = sorted(set(PREDICT_ARRAYS) - set(arrays))
    if missing:
        raise RequestError(missing[0], "missing")
    return header.get("meta", {}), arrays


def predict_input(meta: dict, arrays: dict[str, np.ndarray], limits: Limits, now_ns: int) -> DrivingInput:
    """The DrivingInput of a /predict request: cameras sorted by index, frames (H, W, 3)."""
    frames = arrays["image_frames"]
    indices = arrays["camera_indices"]
    if indices.shape[0] != frames.shape[0]:
        raise RequestError("camera_indices", f"{indices.shape[0]} indices for {frames.shape[0]} cameras")
    declared = meta.get("num_frames_per_camera", frames.shape[1])
    if declared != frames.shape[1]:
        raise RequestError("num_frames_per_camera", f"{declared!r}, but image_frames holds {frames.shape[1]}")
    nav_text = meta.get("nav_text")
    if nav_text is not None and not isinstance(nav_text, str):
        raise RequestError("nav_text", f"expected a string or null, got {type(nav_text).__name__}")
    order = np.argsort(indices, kind="stable")
    count = frames.shape[1]
    spacing_ns = int(FRAME_SPACING_S * 1e9)
    stamps = now_ns - spacing_ns * np.arange(count - 1, -1, -1, dtype=np.int64)
    return driving_input(
        images=np.ascontiguousarray(frames[order].transpose(0, 1, 3, 4, 2)),
        camera_indices=tuple(int(i) for i in indices[order]),
        frame_stamps_ns=np.tile(stamps, (frames.shape[0], 1)),
        t0_ns=now_ns,
        ego_history_xyz=arrays["ego_history_xyz"].reshape(NUM_HISTORY_POSES, 3),
        ego_history_rot=arrays["ego_history_rot"].reshape(NUM_HISTORY_POSES, 3, 3),
        route_text=nav_text,
        limits=limits,
        fields={"images": "image_frames", "ego_history": "ego_history_xyz", "route_text": "nav_text"},
    )


def predict_reply(plan: Plan, server_s: float) -> bytes:
    """status ok, the first sample's reasoning, and the plan's arrays; timings in their *_sec keys."""
    timings = plan.timings_ms
    prep_s = (timings.get("preprocess", 0.0) + timings.get("prompt", 0.0)) / 1e3
    meta = {
        "status": "ok",
        "cot": plan.coc[0] if plan.coc else "",
        "prep_sec": prep_s,
        "tokenize_sec": prep_s,
        "model_sec": timings.get("total", 0.0) / 1e3 - prep_s,
        "post_sec": 0.0,
        "server_sec": server_s,
    }
    return encode(meta, {"traj_batch": plan.xyz.astype(np.float32), "rot_batch": plan.rot.astype(np.float32)})


def error_reply(message: str) -> bytes:
    return encode({"status": "error", "message": message}, {})


def _checked_descriptor(key: str, descriptor: dict) -> tuple[np.dtype, tuple[int, ...]]:
    expected_dtype, expected_shape = PREDICT_ARRAYS[key]
    try:
        dtype = np.dtype(descriptor.get("dtype"))
    except TypeError as error:
        raise RequestError(key, f"unknown dtype {descriptor.get('dtype')!r}") from error
    if dtype != expected_dtype:
        raise RequestError(key, f"expected dtype {expected_dtype.name}, got {dtype.name}")
    shape = descriptor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(side, int) and side >= 0 for side in shape):
        raise RequestError(key, f"shape must be a list of non-negative integers, got {shape!r}")
    fits = len(shape) == len(expected_shape) and all(e is None or e == s for e, s in zip(expected_shape, shape))
    if not fits:
        pattern = tuple("*" if side is None else side for side in expected_shape)
        raise RequestError(key, f"expected shape {pattern}, got {tuple(shape)}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if descriptor.get("nbytes") != nbytes:
        raise RequestError(key, f"nbytes {descriptor.get('nbytes')!r} != {nbytes} for shape {tuple(shape)}")
    return dtype, tuple(shape)
