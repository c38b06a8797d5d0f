"""Resized frames that binary-endpoint clients sent before, so a streamed window travels as
its new frames plus references (issue 14: a W16 plan shares 12 of its 16 frames with the last).

A frame is named exactly by (session, camera, capture stamp, height, width): the session keeps
clients apart, the size keeps frames resized for another geometry apart. Entries are
least-recently-used across all sessions and bounded both in count and in bytes, so a client
that streams forever, or many clients, cannot grow the server. A reference the store cannot
resolve is reported as missing, never guessed: the client then sends the frames again. Frames are
held keyed (core/frame_key.py), so a window built from them carries its frames' keys and the plan
hashes none of them again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, NamedTuple

from ..core.frame_key import KeyedFrame


class FrameKey(NamedTuple):
    session: str
    camera: int
    stamp_ns: int
    height: int
    width: int


class FrameStore:
    """Thread-safe LRU of keyed uint8 (h, w, 3) frames; max_frames and max_bytes bound what it holds."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        if max_frames < 0:
            raise ValueError(f"max_frames: must be >= 0, got {max_frames}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._frames: OrderedDict[FrameKey, KeyedFrame] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def take(self, keys: Iterable[FrameKey]) -> tuple[dict[FrameKey, KeyedFrame], list[FrameKey]]:
        """(the frames held for keys, the keys not held); the ones found become most recent."""
        found: dict[FrameKey, KeyedFrame] = {}
        missing: list[FrameKey] = []
        with self._lock:
            for key in keys:
                frame = self._frames.get(key)
                if frame is None:
                    missing.append(key)
                    continue
                self._frames.move_to_end(key)
                found[key] = frame
        return found, missing

    def put(self, frames: dict[FrameKey, KeyedFrame]) -> None:
        """Hold frames (replacing any under the same key), then evict the least recent until both
        bounds hold. A frame larger than max_bytes on its own is not kept. Keyed frames are
        read-only arrays of their own (keyed_frame), so they are held as given, not copied."""
        with self._lock:
            for key, frame in frames.items():
                old = self._frames.pop(key, None)
                if old is not None:
                    self._bytes -= old.image.nbytes
                self._frames[key] = frame
                self._bytes += frame.image.nbytes
            while self._frames and (len(self._frames) > self.max_frames or self._bytes > self.max_bytes):
                _, evicted = self._frames.popitem(last=False)
                self._bytes -= evicted.image.nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"frames": len(self._frames), "bytes": self._bytes,
                    "max_frames": self.max_frames, "max_bytes": self.max_bytes}
