"""rosbag2 reading and writing without the ros2 CLI (rosbags, sqlite3 or MCAP storage).

Messages come out as rosbags objects, which carry the same field names as rclpy messages,
so code that reads fields (image decoding, odometry) works on both. Custom message types
are deserialized from the definitions the bag embeds; standard ones fall back to the
Kilted typestore.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import cv2
import numpy as np
from rosbags.highlevel import AnyReader
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from alpamayo_ros.inputs.messages import compressed_image_to_rgb, raw_image_to_rgb

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE = "sensor_msgs/msg/CompressedImage"
ODOMETRY = "nav_msgs/msg/Odometry"
STRING = "std_msgs/msg/String"  # the navigation route
TRAJECTORY_SET = "alpamayo_ros_msgs/msg/TrajectorySet"  # the drive node's plans


def kilted_typestore() -> Typestore:
    """Standard ROS 2 Kilted message types."""
    return get_typestore(Stores.ROS2_KILTED)


@dataclass(frozen=True)
class BagMessage:
    """One deserialized message; log_time_ns is when the recorder received it."""

    topic: str
    msgtype: str
    log_time_ns: int
    msg: Any


def decode_image(msg: Any) -> np.ndarray:
    """Image or CompressedImage (rclpy or rosbags object) -> RGB uint8 (H, W, 3).

    Delegates to the drive node's decoders, so tools and tests see exactly the node's pixels.
    """
    if hasattr(msg, "format"):
        return compressed_image_to_rgb(msg)
    return raw_image_to_rgb(msg)


def read_messages(path: str | Path, topics: Sequence[str] | None = None) -> Iterator[BagMessage]:
    """Deserialized messages of a rosbag2 directory in log-time order.

    topics: only these topics (all when None). Raises ValueError naming a requested topic the
    bag does not have, because a silent empty stream hides a typo in a topic map.
    """
    path = Path(path)
    if not (path / "metadata.yaml").is_file():
        raise ValueError(f"bag: {path} is not a rosbag2 directory (no metadata.yaml)")
    with AnyReader([path], default_typestore=kilted_typestore()) as reader:
        conns = reader.connections
        if topics is not None:
            missing = sorted(set(topics) - {c.topic for c in conns})
            if missing:
                have = sorted({c.topic for c in conns})
                raise ValueError(f"bag {path}: topics {missing} not found (bag has {have})")
            conns = [c for c in conns if c.topic in set(topics)]
        for conn, log_time, raw in reader.messages(connections=conns):
            yield BagMessage(conn.topic, conn.msgtype, log_time, reader.deserialize(raw, conn.msgtype))


def bag_time_range(path: str | Path) -> tuple[int, int]:
    """(first, last) log time in ns."""
    with AnyReader([Path(path)], default_typestore=kilted_typestore()) as reader:
        return reader.start_time, reader.end_time


def bag_topics(path: str | Path) -> dict[str, tuple[str, int]]:
    """topic -> (message type, message count)."""
    with AnyReader([Path(path)], default_typestore=kilted_typestore()) as reader:
        out: dict[str, tuple[str, int]] = {}
        for c in reader.connections:
            _, count = out.get(c.topic, (c.msgtype, 0))
            out[c.topic] = (c.msgtype, count + c.msgcount)
        return out


def _msg_dir(pkg: str) -> Path | None:
    """<prefix>/share/<pkg>/msg of an installed interface package, or None.

    Custom interfaces (alpamayo_ros_msgs) are not in the rosbags typestore; their .msg files
    are installed under the venv prefix or an AMENT_PREFIX_PATH entry.
    """
    prefixes = [sys.prefix, *filter(None, os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep))]
    for prefix in prefixes:
        candidate = Path(prefix) / "share" / pkg / "msg"
        if candidate.is_dir():
            return candidate
    return None


def register_msgtype(typestore: Typestore, msgtype: str) -> None:
    """Make msgtype known to typestore from its installed .msg file (with its package siblings).

    Raises ValueError naming the type when no definition can be found.
    """
    if msgtype in typestore.fielddefs:
        return
    pkg, _, name = msgtype.split("/")
    msg_dir = _msg_dir(pkg)
    if msg_dir is None or not (msg_dir / f"{name}.msg").is_file():
        raise ValueError(f"message type {msgtype!r}: not in the Kilted typestore and no installed .msg file")
    types: dict = {}
    # A custom message may nest other messages of its own package: register them together.
    for f in sorted(msg_dir.glob("*.msg")):
        sibling = f"{pkg}/msg/{f.stem}"
        if sibling not in typestore.fielddefs:
            types.update(get_types_from_msg(f.read_text(), sibling))
    typestore.register(types)


def message_class(msgtype: str) -> type:
    """'pkg/msg/Name' -> the generated ROS Python message class (for rclpy publishers/subscribers)."""
    pkg, kind, name = msgtype.split("/")
    try:
        return getattr(importlib.import_module(f"{pkg}.{kind}"), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"message type {msgtype!r}: no Python interface installed ({exc})") from exc


class BagWriter:
    """rosbag2 writer keyed by topic; adds connections on first use.

    Use as a context manager. storage: "mcap" or "sqlite3".
    """

    def __init__(self, path: str | Path, storage: str = "mcap", typestore: Typestore | None = None) -> None:
        plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
        if storage not in plugins:
            raise ValueError(f"storage: expected one of {sorted(plugins)}, got {storage!r}")
        self.typestore = typestore or kilted_typestore()
        self._writer = Writer(Path(path), version=9, storage_plugin=plugins[storage])
        self._conns: dict[str, Any] = {}

    def __enter__(self) -> BagWriter:
        self._writer.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self._writer.close()

    def _connection(self, topic: str, msgtype: str) -> Any:
        conn = self._conns.get(topic)
        if conn is None:
            register_msgtype(self.typestore, msgtype)
            conn = self._writer.add_connection(topic, msgtype, typestore=self.typestore)
            self._conns[topic] = conn
        elif conn.msgtype != msgtype:
            raise ValueError(f"topic {topic}: already written as {conn.msgtype}, got {msgtype}")
        return conn

    def write_raw(self, topic: str, msgtype: str, log_time_ns: int, raw: bytes | memoryview) -> None:
        """Write already-serialized CDR (what rclpy raw subscriptions deliver)."""
        self._writer.write(self._connection(topic, msgtype), int(log_time_ns), raw)

    def write(self, topic: str, msgtype: str, log_time_ns: int, msg: Any) -> None:
        """Serialize a rosbags message object and write it."""
        conn = self._connection(topic, msgtype)
        self._writer.write(conn, int(log_time_ns), self.typestore.serialize_cdr(msg, msgtype))

    # Message builders (rosbags objects) for the converter and for tests that write bags.

    def header(self, stamp_ns: int, frame_id: str) -> Any:
        stamp = self.typestore.types["builtin_interfaces/msg/Time"](sec=int(stamp_ns // 1_000_000_000),
                                                                     nanosec=int(stamp_ns % 1_000_000_000))
        return self.typestore.types["std_msgs/msg/Header"](stamp=stamp, frame_id=frame_id)

    def compressed_image(self, rgb: np.ndarray, stamp_ns: int, frame_id: str, quality: int = 90) -> Any:
        """JPEG CompressedImage from an RGB uint8 image."""
        ok, jpg = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise ValueError(f"rgb: JPEG encoding failed for shape {rgb.shape}")
        cls = self.typestore.types[COMPRESSED_IMAGE]
        return cls(header=self.header(stamp_ns, frame_id), format="jpeg", data=jpg.reshape(-1))

    def raw_image(self, rgb: np.ndarray, stamp_ns: int, frame_id: str) -> Any:
        """rgb8 Image from an RGB uint8 image."""
        h, w, _ = rgb.shape
        cls = self.typestore.types[IMAGE]
        return cls(header=self.header(stamp_ns, frame_id), height=h, width=w, encoding="rgb8",
                   is_bigendian=0, step=w * 3, data=np.ascontiguousarray(rgb, dtype=np.uint8).reshape(-1))

    def odometry(self, stamp_ns: int, xyz: Sequence[float], quat_xyzw: Sequence[float],
                 linear: Sequence[float] = (0.0, 0.0, 0.0), angular: Sequence[float] = (0.0, 0.0, 0.0),
                 frame_id: str = "odom", child_frame_id: str = "base_link") -> Any:
        """nav_msgs/Odometry: pose in frame_id, twist in child_frame_id (REP 105)."""
        ts = self.typestore.types
        vec3, point, quat = ts["geometry_msgs/msg/Vector3"], ts["geometry_msgs/msg/Point"], ts["geometry_msgs/msg/Quaternion"]
        pose = ts["geometry_msgs/msg/PoseWithCovariance"](
            pose=ts["geometry_msgs/msg/Pose"](
                position=point(x=float(xyz[0]), y=float(xyz[1]), z=float(xyz[2])),
                orientation=quat(x=float(quat_xyzw[0]), y=float(quat_xyzw[1]), z=float(quat_xyzw[2]), w=float(quat_xyzw[3]))),
            covariance=np.zeros(36))
        twist = ts["geometry_msgs/msg/TwistWithCovariance"](
            twist=ts["geometry_msgs/msg/Twist"](linear=vec3(x=float(linear[0]), y=float(linear[1]), z=float(linear[2])),
                                                angular=vec3(x=float(angular[0]), y=float(angular[1]), z=float(angular[2]))),
            covariance=np.zeros(36))
        return ts[ODOMETRY](header=self.header(stamp_ns, frame_id), child_frame_id=child_frame_id, pose=pose, twist=twist)
