"""Frames handed over in POSIX shared memory between a client and alpamayo-serve on one host.

A full-HD frame is 6 MB; a W16 window's 4 new frames through loopback HTTP would cost more than
resizing them, so a client on the server's host writes them, at capture size, into a segment it
owns (/dev/shm/<name>, mode 0600) and the request names segment, offset, shape and dtype. The
server copies them out before it answers (the client may then overwrite them) and resizes them on
its own device. Two protocols use this: the binary plan endpoint (FrameSegment, below; names
`alpamayo_<32 hex>`) and the FlashDrive sidecar's (`fdw_<32 hex>`, written by Autoware's client).

The reader opens only names of an expected pattern (no paths, no other processes' segments),
never follows a symlink, checks every byte it reads lies inside the segment, and reads with
pread, not a mapping: a segment shrunk meanwhile gives a short read, not SIGBUS in the server.
Both sides copy a request's 25 MB on several threads where the host has the cores (pread and
numpy's copy release Python's lock; one thread copies ~4-6 GB/s).
"""

from __future__ import annotations

import ipaddress
import mmap
import os
import re
import stat
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .requests import RequestError

SHM_DIR = Path("/dev/shm")
PLAN_SEGMENT = re.compile(r"alpamayo_[0-9a-f]{32}")
SIDECAR_SEGMENT = re.compile(r"fdw_[0-9a-f]{32}")
#: Threads that copy one request's frames side by side: half the cores, at most 8 (1: serial).
_COPY_THREADS = min(8, (os.cpu_count() or 1) // 2)
#: Bytes per thread at least: below this, a thread's hand-off costs more than it saves.
_COPY_PART_BYTES = 4 * 2**20


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1): a peer on this host."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_segment(
    field: str, name: object, pattern: re.Pattern, offset: int, nbytes: int, out: np.ndarray | None = None
) -> np.ndarray:
    """A copy of nbytes at offset of segment name, as uint8 (nbytes,), into out when given (a
    contiguous uint8 array of nbytes, e.g. pinned memory the upload is fast from). Refusals name field.name,
    field.offset or field.shape (the byte count's source); a segment that does not exist here
    (another host or IPC namespace) is reason shm_unavailable, so a client can fall back."""
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise RequestError(f"{field}.name", f"must match {pattern.pattern}, got {str(name)[:80]!r}")
    if offset < 0:
        raise RequestError(f"{field}.offset", f"must be >= 0, got {offset}")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise RequestError(f"{field}.name", f"segment {name} cannot be opened here ({error.strerror}; the same "
                           "host and IPC namespace are needed)", reason="shm_unavailable") from error
    try:
        info = os.fstat(fd)
        size = info.st_size
        if not stat.S_ISREG(info.st_mode):
            raise RequestError(f"{field}.name", f"{name} is not a shared-memory segment")
        if offset > size:
            raise RequestError(f"{field}.offset", f"{offset} is past the end of segment {name} ({size} bytes)")
        if offset + nbytes > size:
            raise RequestError(f"{field}.shape", f"needs {nbytes} bytes from offset {offset}, past the end of "
                               f"segment {name} ({size} bytes)")
        out = np.empty(nbytes, dtype=np.uint8) if out is None else out.reshape(nbytes)
        view = memoryview(out)

        def read_part(start: int, end: int) -> None:
            done = start
            while done < end:
                read = os.preadv(fd, [view[done:end]], offset + done)
                if read == 0:
                    raise RequestError(f"{field}.shape", f"segment {name} shrank to {offset + done} bytes while read")
                done += read

        parts = _byte_parts(nbytes)
        _run_all([lambda start=start, end=end: read_part(start, end) for start, end in parts])
        return out
    finally:
        os.close(fd)


@lru_cache(maxsize=1)
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(_COPY_THREADS, 1), thread_name_prefix="shm-copy")


def _byte_parts(nbytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges that split nbytes over up to _COPY_THREADS threads."""
    count = max(1, min(_COPY_THREADS, nbytes // _COPY_PART_BYTES))
    step = max(1, -(-nbytes // count))
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _run_all(tasks: list[Callable[[], None]]) -> None:
    """Run tasks, on the copy threads when there are several; every one has ended when this
    returns or raises (the first failure), so none still uses a file or map the caller closes."""
    if len(tasks) <= 1 or _COPY_THREADS < 2:
        for task in tasks:
            task()
        return
    futures = [_copy_pool().submit(task) for task in tasks]
    wait(futures)
    for future in futures:
        future.result()


class FrameSegment:
    """A client's reusable segment for one request's new frames at a time (not thread-safe).

    It grows to the largest request written (a new segment, the old one unlinked) and is
    unlinked on close(), when garbage-collected, and at interpreter exit, so /dev/shm keeps
    nothing of a client that ended normally. Space is reserved with posix_fallocate, so a full
    /dev/shm (a container's 64 MB default) fails here with OSError instead of SIGBUS on a write.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.size = 0
        self._map: mmap.mmap | None = None
        self._finalizer: weakref.finalize | None = None

    def write(self, frames: Sequence[np.ndarray]) -> str:
        """Copy equal-shaped uint8 frames, in order, from the segment's start; returns its name."""
        if not frames:
            return self._reserve(1)
        shape = frames[0].shape
        if any(frame.dtype != np.uint8 or frame.shape != shape for frame in frames):
            raise ValueError(f"frames: expected uint8 frames of one shape {shape}")
        nbytes = len(frames) * frames[0].nbytes
        name = self._reserve(nbytes)
        rows = np.ndarray((len(frames), *shape), dtype=np.uint8, buffer=self._map)
        _run_all([lambda row=row, frame=frame: np.copyto(row, frame) for row, frame in zip(rows, frames)])
        del rows  # the map cannot close while a view of it lives
        return name

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._map, self._finalizer, self.name, self.size = None, None, None, 0

    def _reserve(self, nbytes: int) -> str:
        """A segment of at least nbytes, created on first use or when this one is too small."""
        if self.name is not None and nbytes <= self.size:
            return self.name
        self.close()
        name = f"alpamayo_{uuid.uuid4().hex}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            segment = mmap.mmap(fd, nbytes)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._map, self.name, self.size = segment, name, nbytes
        self._finalizer = weakref.finalize(self, _release, segment, path)
        return name


def _release(segment: mmap.mmap, path: Path) -> None:
    """Unlink first: the name must go even if a view of the map (a write in flight) keeps it open."""
    path.unlink(missing_ok=True)
    try:
        segment.close()
    except BufferError:  # the mapping goes with the last view
        pass
