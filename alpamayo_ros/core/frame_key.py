"""Frame keys: the identity of one camera frame (camera, capture stamp, size, full content).

Torch-free, so the drive loop can key each frame where it arrives (once, off the plan's
critical path) and a plan reuses the key instead of hashing its 16 frames again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import blake3
import numpy as np

#: the fingerprint part of a key: 128 bits as hex
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")


def frame_fingerprint(image: np.ndarray) -> str:
    """A 128-bit BLAKE3 digest of every byte of image: any changed pixel changes it.

    BLAKE3 (SIMD, ~1 ms for a full-HD RGB frame on one core, bench/RESULTS.md) rather than a
    sparse sample of the pixels: a changed region between the samples would pass as the old
    frame. A non-contiguous view is hashed through one contiguous copy.
    """
    return blake3.blake3(memoryview(np.ascontiguousarray(image)).cast("B"), max_threads=1).hexdigest(16)


def frame_key_prefix(camera: int, stamp_ns: int, height: int, width: int) -> str:
    """The part of a frame's key that its slot decides (everything but the fingerprint)."""
    return f"cam{camera}-{stamp_ns}-{height}x{width}-"


def frame_key(camera: int, stamp_ns: int, image: np.ndarray) -> str:
    """Identity of one camera frame: its camera, capture time, size and full-content fingerprint.

    The stamp alone would do for live cameras; the fingerprint guards against sources that
    reuse stamps with new pixels (a paused simulator, hand-built inputs, a client's re-send).
    """
    return frame_key_prefix(camera, stamp_ns, image.shape[0], image.shape[1]) + frame_fingerprint(image)


def is_frame_key(key: object, camera: int, stamp_ns: int, height: int, width: int) -> bool:
    """Whether key has the form frame_key gives a frame of this camera, stamp and size."""
    prefix = frame_key_prefix(camera, stamp_ns, height, width)
    return isinstance(key, str) and key.startswith(prefix) and _FINGERPRINT.fullmatch(key, len(prefix)) is not None


@dataclass(frozen=True)
class KeyedFrame:
    """A decoded camera frame (H, W, 3) and its frame_key, made by keyed_frame: read-only, so the
    key can never name other pixels than these."""

    image: np.ndarray
    key: str


def keyed_frame(camera: int, stamp_ns: int, image: np.ndarray) -> KeyedFrame:
    """image, made read-only, with its key. The frame becomes the key's: writing to image raises
    from now on. A view of another array is copied first (read-only on a view would leave the
    pixels writable through its base)."""
    if image.base is not None:
        image = image.copy()
    image.flags.writeable = False
    return KeyedFrame(image, frame_key(camera, stamp_ns, image))
