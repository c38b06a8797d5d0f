"""`alpamayo-convert-pai`: one PhysicalAI-AV clip -> a rosbag2 (MCAP) the node and evaluator read.

Reads a local copy of the dataset laid out as on Hugging Face (what physical_ai_av's
download_clip_features leaves under its local_dir), without the physical_ai_av package:

    camera/<camera>/<camera>.chunk_NNNN.zip      <clip>.<camera>.mp4, <clip>.<camera>.timestamps.parquet
    labels/egomotion/egomotion.chunk_NNNN.zip    <clip>.egomotion.parquet
    clip_index.parquet                           clip_id -> chunk (optional: zips are searched otherwise)

Members already extracted next to the zips (<dir>/<member>) are used as they are.
Egomotion (~100 Hz, microsecond stamps, pose/velocity in the clip's anchor frame) becomes
nav_msgs/Odometry with the pose in "odom" and the twist in the vehicle frame (REP 105);
camera frames become JPEG CompressedImage stamped with their capture time.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import cv2
import numpy as np
import pyarrow.parquet as pq

from alpamayo_ros.core.types import CAMERAS
from alpamayo_ros.eval.bags import COMPRESSED_IMAGE, ODOMETRY, BagWriter
from alpamayo_ros.inputs.ego_history import quaternion_to_matrix

logger = logging.getLogger(__name__)

US = 1_000  # ns per microsecond
DEFAULT_CAMERAS = tuple(CAMERAS[i][0] for i in (0, 1, 2, 6))  # upstream's default 4-camera set
# {short} is the camera name without "camera_" and the FOV suffix: the node's default topics
DEFAULT_TOPIC_TEMPLATE = "/camera/{short}/image/compressed"
EGOMOTION_COLUMNS = ("timestamp", "x", "y", "z", "qx", "qy", "qz", "qw", "vx", "vy", "vz", "curvature")


class ClipFiles:
    """Finds one clip's members in a local dataset copy (extracted file or chunk zip)."""

    def __init__(self, root: str | Path, clip_id: str) -> None:
        self.root, self.clip_id = Path(root), clip_id
        if not self.root.is_dir():
            raise ValueError(f"root: {self.root} is not a directory")
        self.chunk = self._chunk_from_index()

    def _chunk_from_index(self) -> int | None:
        index = self.root / "clip_index.parquet"
        if not index.is_file():
            return None
        table = pq.read_table(index).to_pydict()
        ids = table.get("clip_id") or table.get("__index_level_0__") or []
        if self.clip_id not in ids:
            raise ValueError(f"clip: {self.clip_id} is not in {index}")
        return int(table["chunk"][ids.index(self.clip_id)])

    def read(self, directory: str, member: str) -> bytes:
        """Bytes of <clip>.<member> under root/directory."""
        name = f"{self.clip_id}.{member}"
        folder = self.root / directory
        if (folder / name).is_file():
            return (folder / name).read_bytes()
        zips = sorted(folder.glob("*.chunk_*.zip"))
        if self.chunk is not None:
            # the chunk named by the index first, the rest only if the layout differs
            zips.sort(key=lambda z: not z.name.endswith(f".chunk_{self.chunk:04d}.zip"))
        for path in zips:
            with zipfile.ZipFile(path) as zf:
                if name in zf.namelist():
                    return zf.read(name)
        raise ValueError(f"clip {self.clip_id}: {name} not found under {folder} (looked at {len(zips)} chunk zips)")


@dataclass(frozen=True)
class Egomotion:
    """Egomotion table as arrays (SI units, anchor frame; stamps in ns)."""

    stamps_ns: np.ndarray
    xyz: np.ndarray
    quat_xyzw: np.ndarray
    velocity: np.ndarray
    curvature: np.ndarray


def camera_topic(template: str, camera: str) -> str:
    """Fill {camera} (dataset name) and {short} (e.g. front_wide for camera_front_wide_120fov)."""
    short = re.sub(r"_\d+fov$", "", camera.removeprefix("camera_"))
    return template.format(camera=camera, short=short)


def read_egomotion(files: ClipFiles) -> Egomotion:
    table = pq.read_table(io.BytesIO(files.read("labels/egomotion", "egomotion.parquet")))
    missing = [c for c in EGOMOTION_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"egomotion parquet: missing columns {missing}")
    col = {c: table.column(c).to_numpy() for c in EGOMOTION_COLUMNS}
    order = np.argsort(col["timestamp"], kind="stable")
    return Egomotion(
        stamps_ns=col["timestamp"].astype(np.int64)[order] * US,
        xyz=np.stack([col["x"], col["y"], col["z"]], -1)[order],
        quat_xyzw=np.stack([col["qx"], col["qy"], col["qz"], col["qw"]], -1)[order],
        velocity=np.stack([col["vx"], col["vy"], col["vz"]], -1)[order],
        curvature=col["curvature"][order],
    )


def iter_camera_frames(files: ClipFiles, camera: str) -> Iterator[tuple[int, np.ndarray]]:
    """(capture stamp ns, RGB frame) for every frame of one camera video, in order."""
    stamps = pq.read_table(io.BytesIO(files.read(f"camera/{camera}", f"{camera}.timestamps.parquet")))
    if "timestamp" not in stamps.column_names:
        raise ValueError(f"{camera}.timestamps.parquet: no 'timestamp' column")
    stamps_ns = stamps.column("timestamp").to_numpy().astype(np.int64) * US
    video = files.read(f"camera/{camera}", f"{camera}.mp4")
    with tempfile.NamedTemporaryFile(suffix=".mp4") as tmp:  # OpenCV reads videos from paths only
        tmp.write(video)
        tmp.flush()
        cap = cv2.VideoCapture(tmp.name)
        if not cap.isOpened():
            raise ValueError(f"{camera}.mp4: OpenCV cannot open the video")
        count = 0
        try:
            while count < len(stamps_ns):
                ok, bgr = cap.read()
                if not ok:
                    break
                yield int(stamps_ns[count]), cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                count += 1
        finally:
            cap.release()
    if count != len(stamps_ns):
        logger.warning("%s: %d timestamps but %d decoded frames; kept %d", camera, len(stamps_ns), count, count)


def _keep_every(stamps: Iterator[tuple[int, np.ndarray]], hz: float) -> Iterator[tuple[int, np.ndarray]]:
    """Thin a frame stream to about hz (a frame is kept once 0.9 periods passed since the last)."""
    min_gap = int(0.9e9 / hz) if hz > 0 else 0
    last = None
    for stamp, frame in stamps:
        if last is None or stamp - last >= min_gap:
            last = stamp
            yield stamp, frame


def convert_clip(root: str | Path, clip_id: str, out: str | Path, cameras: Sequence[str] = DEFAULT_CAMERAS,
                 topic_template: str = DEFAULT_TOPIC_TEMPLATE, odom_topic: str = "/odom",
                 camera_hz: float = 10.0, max_width: int = 0, jpeg_quality: int = 90,
                 start_s: float = 0.0, duration_s: float = 0.0,
                 camera_topics: Mapping[str, str] | None = None) -> dict[str, int]:
    """Write the clip as an MCAP bag; returns topic -> message count.

    camera_topics: dataset camera -> topic, instead of topic_template (the evaluator passes the
        topics of its settings, so a clip converted in a worker matches any params file).
    camera_hz: thin camera streams to this rate (0 keeps every frame); the model uses 10 Hz.
    max_width: downscale wider frames to this width (0 keeps the size).
    start_s / duration_s: window relative to the first egomotion sample (0 duration = to the end).
    """
    known = {name for name, _ in CAMERAS.values()}
    unknown = [c for c in cameras if c not in known]
    if unknown:
        raise ValueError(f"cameras: unknown {unknown} (known: {sorted(known)})")
    files = ClipFiles(root, clip_id)
    ego = read_egomotion(files)
    begin = int(ego.stamps_ns[0] + start_s * 1e9)
    end = int(begin + duration_s * 1e9) if duration_s > 0 else int(ego.stamps_ns[-1])
    counts: dict[str, int] = {}
    with BagWriter(out, storage="mcap") as writer:
        rot = quaternion_to_matrix(ego.quat_xyzw / np.linalg.norm(ego.quat_xyzw, axis=-1, keepdims=True))
        body_velocity = np.einsum("nji,nj->ni", rot, ego.velocity)  # R^T v: anchor -> vehicle frame
        for k in np.flatnonzero((ego.stamps_ns >= begin) & (ego.stamps_ns <= end)):
            stamp = int(ego.stamps_ns[k])
            yaw_rate = float(ego.curvature[k]) * float(body_velocity[k, 0])  # kappa * v
            writer.write(odom_topic, ODOMETRY, stamp,
                         writer.odometry(stamp, ego.xyz[k], ego.quat_xyzw[k], body_velocity[k], (0.0, 0.0, yaw_rate)))
            counts[odom_topic] = counts.get(odom_topic, 0) + 1
        for camera in cameras:
            topic = camera_topics[camera] if camera_topics else camera_topic(topic_template, camera)
            for stamp, rgb in _keep_every(iter_camera_frames(files, camera), camera_hz):
                if not begin <= stamp <= end:
                    continue
                if max_width and rgb.shape[1] > max_width:
                    height = round(rgb.shape[0] * max_width / rgb.shape[1])
                    rgb = cv2.resize(rgb, (max_width, height), interpolation=cv2.INTER_AREA)
                writer.write(topic, COMPRESSED_IMAGE, stamp, writer.compressed_image(rgb, stamp, camera, jpeg_quality))
                counts[topic] = counts.get(topic, 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-convert-pai", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="local PhysicalAI-AV dataset copy")
    parser.add_argument("--clip", required=True, help="clip id (UUID)")
    parser.add_argument("--out", type=Path, required=True, help="bag directory to create")
    parser.add_argument("--cameras", nargs="+", default=list(DEFAULT_CAMERAS), help="dataset camera names")
    parser.add_argument("--topic-template", default=DEFAULT_TOPIC_TEMPLATE,
                        help="camera topic; {camera} = dataset camera name, {short} = it without camera_ and FOV")
    parser.add_argument("--odom-topic", default="/odom")
    parser.add_argument("--camera-hz", type=float, default=10.0, help="thin cameras to this rate (0: keep all)")
    parser.add_argument("--max-width", type=int, default=0, help="downscale frames wider than this (0: keep)")
    parser.add_argument("--jpeg-quality", type=int, default=90)
    parser.add_argument("--start-s", type=float, default=0.0, help="window start after the clip's first pose")
    parser.add_argument("--duration-s", type=float, default=0.0, help="window length (0: to the end)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.out.exists():
        parser.exit(2, f"alpamayo-convert-pai: error: --out {args.out}: already exists (the bag is created there)\n")
    try:
        counts = convert_clip(args.root, args.clip, args.out, args.cameras, args.topic_template, args.odom_topic,
                              args.camera_hz, args.max_width, args.jpeg_quality, args.start_s, args.duration_s)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"alpamayo-convert-pai: error: {exc}\n")
    for topic, n in sorted(counts.items()):
        logger.info("%s: %d messages", topic, n)


if __name__ == "__main__":
    main()
