"""Helpers of the test_serve_* modules: a real alpamayo-serve process on a free loopback port,
a tiny checkpoint with small vision frames (so plans on the CPU stay cheap), PNG data URLs."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import uuid
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from alpamayo_ros.core.types import DrivingInput
from alpamayo_ros.serve.process import ServerProcess
from alpamayo_ros.serve.shm import SHM_DIR

#: Vision pixel bounds of the small-frames checkpoint: a 64x96 frame is 6 LLM tokens.
SMALL_PIXELS = (4096, 8192)


def small_frames_checkpoint(source: Path, target: Path) -> Path:
    """A copy of the tiny checkpoint whose processor resizes frames to ~6k pixels (not ~180k)."""
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["min_pixels"], config["max_pixels"] = SMALL_PIXELS
    config_path.write_text(json.dumps(config, indent=1))
    return target


def hf_server(checkpoint: Path, log_path: Path, *extra: str) -> ServerProcess:
    """alpamayo-serve on the CPU with the HF backend (quiet logs), not yet started."""
    args = ["--checkpoint", str(checkpoint), "--backend", "hf", "--device", "cpu", "--log-level", "warning", *extra]
    return ServerProcess(args, log_path)


def plan_segments() -> set[str]:
    """Names of the binary endpoint clients' shared-memory segments now in /dev/shm."""
    return {path.name for path in SHM_DIR.glob("alpamayo_*")}


def png_data_url(image: np.ndarray, image_format: str = "PNG") -> str:
    """uint8 RGB (H, W, 3) as a base64 data URL (PNG, or any format PIL writes)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=image_format)
    return f"data:image/{image_format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_request_parts(inputs: DrivingInput) -> tuple[list[dict], list[dict]]:
    """image_url content parts and their image_meta entries for every frame of inputs."""
    parts, meta = [], []
    for camera, stamps, row in zip(inputs.camera_indices, inputs.frame_stamps_ns, inputs.images):
        for stamp, image in zip(stamps, row):
            parts.append({"type": "image_url", "image_url": {"url": png_data_url(image)}})
            meta.append({"camera_index": int(camera), "stamp_ns": int(stamp)})
    return parts, meta


class SidecarClient:
    """A client of the FlashDrive sidecar protocol written from its published facts (Autoware's
    alpamayo-autoware flashdrive_sidecar wire.py), independent of alpamayo_ros.serve.sidecar:
    [4-byte big-endian header length][JSON {"meta", "arrays": [{key, dtype, shape, nbytes[, shm]}]}]
    [inline array bytes]; arrays named in shm_keys travel in POSIX shared memory (fdw_<hex>),
    which the client unlinks after the reply."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.http = httpx.Client(base_url=url, headers=headers or {}, timeout=120)

    def post(self, path: str, meta: dict, arrays: dict[str, np.ndarray], shm_keys: tuple[str, ...] = ()) -> tuple[int, dict, dict]:
        from multiprocessing import shared_memory

        segments, descriptors, inline = [], [], []
        try:
            for key, array in arrays.items():
                array = np.ascontiguousarray(array)
                descriptor = {"key": key, "dtype": str(array.dtype), "shape": list(array.shape), "nbytes": int(array.nbytes)}
                if key in shm_keys:
                    segment = shared_memory.SharedMemory(name=f"fdw_{uuid.uuid4().hex}", create=True, size=array.nbytes)
                    segments.append(segment)
                    np.ndarray(array.shape, array.dtype, buffer=segment.buf)[:] = array
                    descriptor["shm"] = segment.name
                else:
                    inline.append(array.tobytes())
                descriptors.append(descriptor)
            header = json.dumps({"meta": meta, "arrays": descriptors}).encode()
            body = struct.pack(">I", len(header)) + header + b"".join(inline)
            response = self.http.post(path, content=body, headers={"Content-Type": "application/octet-stream"})
        finally:
            for segment in segments:
                segment.close()
                segment.unlink()
        reply_meta, reply_arrays = self.decode(response.content)
        return response.status_code, reply_meta, reply_arrays

    @staticmethod
    def decode(body: bytes) -> tuple[dict, dict[str, np.ndarray]]:
        (length,) = struct.unpack_from(">I", body)
        header = json.loads(body[4 : 4 + length])
        offset, arrays = 4 + length, {}
        for descriptor in header["arrays"]:
            raw = body[offset : offset + descriptor["nbytes"]]
            offset += descriptor["nbytes"]
            arrays[descriptor["key"]] = np.frombuffer(raw, dtype=descriptor["dtype"]).reshape(descriptor["shape"])
        return header["meta"], arrays
