"""alpamayo-convert-pai on a small synthetic clip laid out like the PhysicalAI-AV dataset."""

import io
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alpamayo_ros.eval.bags import bag_topics, decode_image, read_messages
from alpamayo_ros.eval.evaluate import load_params_file
from alpamayo_ros.eval.cli import main as eval_main
from alpamayo_ros.eval.physical_ai_av import convert_clip, main
from alpamayo_ros.inputs.messages import stamp_to_ns

CLIP = "0b7c5a9e-1111-4c1e-9d2a-5f3a2b1c0d9e"
OTHER = "77aa0000-2222-4e2f-8a3b-6c4d5e6f7a8b"  # same chunk, different content: must not leak in
CAMS = ("camera_front_wide_120fov", "camera_cross_left_120fov")
# the drive node's default topics (config/drive.yaml), so converted clips need no topic map
TOPICS = {"camera_front_wide_120fov": "/camera/front_wide/image/compressed",
          "camera_cross_left_120fov": "/camera/cross_left/image/compressed"}
FPS, N_FRAMES = 30, 60
START_US = 1_000_000
SPEED = 5.0


def _parquet(columns: dict) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def _video(levels: list[int], tmp: Path) -> bytes:
    path = tmp / "v.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (64, 48))
    for level in levels:
        frame = np.full((48, 64, 3), level, np.uint8)
        frame[:, :8] = (0, 0, 255)  # a red (BGR) stripe on the left, to check channel order
        writer.write(frame)
    writer.release()
    return path.read_bytes()


def _level(cam: int, k: int) -> int:
    return 20 + 3 * k + 10 * cam


def _egomotion(clip_shift: float) -> bytes:
    t_us = START_US + np.arange(0, 2_200_000, 10_000)  # 100 Hz, 2.2 s
    t = (t_us - START_US) / 1e6
    yaw = math.pi / 2  # heading +y in the anchor frame
    return _parquet({
        "timestamp": t_us.astype(np.int64), "x": np.full_like(t, 3.0 + clip_shift), "y": SPEED * t, "z": np.full_like(t, 0.5),
        "qx": np.zeros_like(t), "qy": np.zeros_like(t), "qz": np.full_like(t, math.sin(yaw / 2)),
        "qw": np.full_like(t, math.cos(yaw / 2)), "vx": np.zeros_like(t), "vy": np.full_like(t, SPEED),
        "vz": np.zeros_like(t), "ax": np.zeros_like(t), "ay": np.zeros_like(t), "az": np.zeros_like(t),
        "curvature": np.full_like(t, 0.02)})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pai")
    chunk = 7
    pq.write_table(pa.table({"clip_id": [OTHER, CLIP], "chunk": [chunk, chunk]}), root / "clip_index.parquet")
    ego_dir = root / "labels" / "egomotion"
    ego_dir.mkdir(parents=True)
    with zipfile.ZipFile(ego_dir / f"egomotion.chunk_{chunk:04d}.zip", "w") as zf:
        zf.writestr(f"{OTHER}.egomotion.parquet", _egomotion(100.0))
        zf.writestr(f"{CLIP}.egomotion.parquet", _egomotion(0.0))
    for c, cam in enumerate(CAMS):
        cam_dir = root / "camera" / cam
        cam_dir.mkdir(parents=True)
        stamps = START_US + 1_000 * c + np.arange(N_FRAMES, dtype=np.int64) * 1_000_000 // FPS
        with zipfile.ZipFile(cam_dir / f"{cam}.chunk_{chunk:04d}.zip", "w") as zf:
            zf.writestr(f"{OTHER}.{cam}.mp4", _video([250] * N_FRAMES, root))
            zf.writestr(f"{OTHER}.{cam}.timestamps.parquet", _parquet({"timestamp": stamps}))
            zf.writestr(f"{CLIP}.{cam}.mp4", _video([_level(c, k) for k in range(N_FRAMES)], root))
            zf.writestr(f"{CLIP}.{cam}.timestamps.parquet", _parquet({"timestamp": stamps}))
    return root


@pytest.fixture(scope="module")
def bag(dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bag") / "clip"
    main(["--root", str(dataset), "--clip", CLIP, "--out", str(out), "--cameras", *CAMS])
    return out


def test_topics_and_counts(bag):
    topics = bag_topics(bag)
    assert topics == {
        "/odom": ("nav_msgs/msg/Odometry", 220),
        **{TOPICS[cam]: ("sensor_msgs/msg/CompressedImage", N_FRAMES // 3) for cam in CAMS},
    }
    assert list(bag.glob("*.mcap"))


def test_camera_frames_keep_capture_stamps_and_content(bag):
    for c, cam in enumerate(CAMS):
        msgs = [m for m in read_messages(bag, topics=[TOPICS[cam]])]
        stamps = [stamp_to_ns(m.msg.header.stamp) for m in msgs]
        # 30 fps thinned to 10 Hz keeps frames 0, 3, 6, ...
        want_us = START_US + 1_000 * c + np.arange(0, N_FRAMES, 3) * 1_000_000 // FPS
        assert stamps == [int(u) * 1000 for u in want_us]
        assert [m.log_time_ns for m in msgs] == stamps
        for j, m in enumerate(msgs):
            rgb = decode_image(m.msg)
            assert rgb.shape == (48, 64, 3)
            assert abs(float(rgb[:, 16:].mean()) - _level(c, 3 * j)) < 4.0
            assert rgb[:, :6, 0].mean() > 200 and rgb[:, :6, 2].mean() < 60  # red stays red in RGB


def test_odometry_pose_and_body_frame_twist(bag):
    msgs = list(read_messages(bag, topics=["/odom"]))
    first, last = msgs[0].msg, msgs[-1].msg
    assert stamp_to_ns(first.header.stamp) == START_US * 1000
    assert (first.header.frame_id, first.child_frame_id) == ("odom", "base_link")
    assert first.pose.pose.position.x == pytest.approx(3.0)
    assert last.pose.pose.position.y == pytest.approx(SPEED * 2.19)
    assert last.pose.pose.orientation.z == pytest.approx(math.sin(math.pi / 4))
    # anchor velocity (0, 5) with heading +y is 5 m/s straight ahead in the vehicle frame
    assert last.twist.twist.linear.x == pytest.approx(SPEED)
    assert last.twist.twist.linear.y == pytest.approx(0.0, abs=1e-9)
    assert last.twist.twist.angular.z == pytest.approx(0.02 * SPEED)


def test_time_window_and_resize(dataset, tmp_path):
    out = tmp_path / "window"
    counts = convert_clip(dataset, CLIP, out, cameras=CAMS[:1], start_s=0.5, duration_s=1.0, max_width=32)
    assert counts["/odom"] == 101
    msgs = list(read_messages(out, topics=[TOPICS[CAMS[0]]]))
    stamps = [stamp_to_ns(m.msg.header.stamp) for m in msgs]
    assert min(stamps) >= (START_US + 500_000) * 1000 and max(stamps) <= (START_US + 1_500_000) * 1000
    assert decode_image(msgs[0].msg).shape == (24, 32, 3)


def test_unknown_clip_and_camera_are_named(dataset, tmp_path):
    with pytest.raises(ValueError, match="clip"):
        convert_clip(dataset, "not-a-clip", tmp_path / "a")
    with pytest.raises(ValueError, match="camera_nope"):
        convert_clip(dataset, CLIP, tmp_path / "b", cameras=["camera_nope"])


def test_default_topics_are_the_node_defaults(bag):
    shipped = load_params_file(Path(__file__).resolve().parents[1] / "config" / "drive.yaml")
    assert set(TOPICS.values()) <= set(shipped["cameras.topics"]) and "/odom" == shipped["odometry.topic"]
    assert set(TOPICS.values()) <= set(bag_topics(bag))


@pytest.mark.parametrize("args, message", [
    (["--root", "/no/such/root", "--clip", CLIP], "root: /no/such/root is not a directory"),
    (["--root", "{dataset}", "--clip", "not-a-clip"], "clip: not-a-clip is not in"),
])
def test_cli_errors_are_one_line(args, message, dataset, tmp_path):
    args = [a.format(dataset=dataset) for a in args]
    run = subprocess.run([sys.executable, "-m", "alpamayo_ros.eval.physical_ai_av", *args, "--out", str(tmp_path / "bag")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and message in run.stderr


def test_evaluator_converts_listed_clips(dataset, tiny_checkpoint, tmp_path):
    """--clips: each clip becomes a temporary bag on the settings' own topics and is evaluated."""
    clips = tmp_path / "clips.txt"
    clips.write_text(f"# clips to score\n{CLIP}\n")
    params = tmp_path / "eval.yaml"
    params.write_text("/**:\n  ros__parameters:\n"
                      f"    model.checkpoint_path: {tiny_checkpoint}\n"
                      "    cameras:\n      topics: [/front, /left]\n      indices: [1, 0]\n"
                      "      transports: [compressed, compressed]\n")
    eval_main(["--clips", str(clips), "--pai-root", str(dataset), "--params-file", str(params),
               "--out", str(tmp_path / "out"), "--no-progress"])
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [b["bag"] for b in doc["bags"]] == [CLIP] and doc["failed"] == []
    assert doc["ticks_total"] >= 10  # a 2 s clip: every tick skipped (too short for 1.5 s + 6.4 s), none lost
    assert sum(doc["skipped"].values()) == doc["ticks_total"]
