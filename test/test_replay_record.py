"""alpamayo-replay -> alpamayo-record across processes round-trips a bag.

Real DDS between three processes (replayer, recorder, pytest): same topics, same counts,
same decoded fields, plus a /clock that follows the bag time.
"""

import subprocess
from pathlib import Path

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory
from alpamayo_ros.testing.rig import VENV_BIN, ros_env, stop_process, unique_domain_id

from alpamayo_ros.eval.bags import BagWriter, bag_topics, decode_image, read_messages, register_msgtype
from alpamayo_ros.inputs.messages import stamp_to_ns

T0 = 1_700_000_000_000_000_000
CAMS = ("/cam/front/compressed", "/cam/left/compressed")
TRAJ_SET = "alpamayo_ros_msgs/msg/TrajectorySet"


def _image(k: int, h: int = 60, w: int = 80) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([(xx * 3 + k * 7) % 256, (yy * 4) % 256, np.full_like(xx, 40 * (k % 6))], -1).astype(np.uint8)


def _write_source_bag(path: Path) -> None:
    """1 s of two JPEG cameras (10 Hz), a raw rgb8 camera (5 Hz), odometry (50 Hz) and a custom msg."""
    with BagWriter(path, storage="sqlite3") as w:
        ts = w.typestore
        for i in range(50):
            t = T0 + i * 20_000_000
            w.write("/odom", "nav_msgs/msg/Odometry", t,
                    w.odometry(t, (0.2 * i, 0.01 * i, 0.0), (0.0, 0.0, np.sin(0.001 * i), np.cos(0.001 * i)), (10.0, 0, 0)))
            if i % 5 == 0:
                for c, topic in enumerate(CAMS):
                    w.write(topic, "sensor_msgs/msg/CompressedImage", t + c, w.compressed_image(_image(i + c), t, topic))
            if i % 10 == 0:
                w.write("/cam/rear/image_raw", "sensor_msgs/msg/Image", t + 5, w.raw_image(_image(i + 9), t, "rear"))
        # The node's custom output type, known from the installed alpamayo_ros_msgs .msg files.
        register_msgtype(ts, TRAJ_SET)
        traj_cls, set_cls, pose_cls = ts.types["alpamayo_ros_msgs/msg/Trajectory"], ts.types[TRAJ_SET], ts.types["geometry_msgs/msg/Pose"]
        point_cls, quat_cls = ts.types["geometry_msgs/msg/Point"], ts.types["geometry_msgs/msg/Quaternion"]
        for j in range(2):
            poses = [pose_cls(position=point_cls(x=float(k + j), y=0.5, z=0.0), orientation=quat_cls(x=0.0, y=0.0, z=0.0, w=1.0))
                     for k in range(3)]
            msg = set_cls(header=w.header(T0 + j, "base_link"), dt_s=0.1, horizon_s=6.4,
                          samples=[traj_cls(poses=poses)], scores=np.array([1.5 + j], np.float32),
                          selected_index=0, selection_policy="first")
            w.write("/alpamayo/trajectories", TRAJ_SET, T0 + 500_000_000 + j * 100_000_000, msg)


def replay(src: Path, env: dict[str, str], rec_log: Path, *args: str, timeout_s: float) -> str:
    """Run alpamayo-replay to its end and return its output; a failure or a hang shows both
    processes' logs (the recorder's says whether it discovered the topics)."""
    try:
        play = subprocess.run([str(VENV_BIN / "alpamayo-replay"), str(src), *args],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as hung:  # its output arrives as bytes even with text=True
        said = hung.stderr.decode(errors="replace") if isinstance(hung.stderr, bytes) else hung.stderr or ""
        raise AssertionError(f"replay still running after {timeout_s} s\n--- replay:\n{said}\n"
                             f"--- recorder:\n{rec_log.read_text()}") from None
    output = play.stdout + play.stderr
    assert play.returncode == 0, f"{output}\n--- recorder:\n{rec_log.read_text()}"
    return output


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rr")
    src, out = tmp / "src", tmp / "rec"
    _write_source_bag(src)
    topics = sorted(bag_topics(src))
    env = ros_env(unique_domain_id())
    rec_log = tmp / "record.log"
    with open(rec_log, "wb") as log:
        rec = subprocess.Popen([str(VENV_BIN / "alpamayo-record"), "--topics", *topics, "/clock", "--out", str(out)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        output = replay(src, env, rec_log, "--rate", "2", "--wait-timeout", "30", timeout_s=90)
        assert "published 77 messages" in output
    finally:
        code = stop_process(rec, timeout_s=30)
    assert code == 0, rec_log.read_text()
    return src, out


def test_same_topics_and_counts(round_trip):
    src, out = round_trip
    want, got = bag_topics(src), bag_topics(out)
    clock_type, clock_count = got.pop("/clock")
    assert clock_type == "rosgraph_msgs/msg/Clock" and clock_count > 10
    assert got == want


def test_decoded_fields_match(round_trip):
    src, out = round_trip
    by_topic: dict = {}
    for m in read_messages(src):
        by_topic.setdefault(m.topic, []).append(m.msg)
    got: dict = {}
    for m in read_messages(out, topics=list(by_topic)):
        got.setdefault(m.topic, []).append(m.msg)
    for topic in CAMS:
        assert [stamp_to_ns(m.header.stamp) for m in got[topic]] == [stamp_to_ns(m.header.stamp) for m in by_topic[topic]]
        for a, b in zip(by_topic[topic], got[topic]):
            assert a.format == b.format and bytes(a.data) == bytes(b.data)
    for a, b in zip(by_topic["/cam/rear/image_raw"], got["/cam/rear/image_raw"]):
        np.testing.assert_array_equal(decode_image(a), decode_image(b))
    for a, b in zip(by_topic["/odom"], got["/odom"]):
        assert stamp_to_ns(a.header.stamp) == stamp_to_ns(b.header.stamp)
        pa, pb = a.pose.pose, b.pose.pose
        assert (pa.position.x, pa.position.y, pa.orientation.z, pa.orientation.w) == \
               (pb.position.x, pb.position.y, pb.orientation.z, pb.orientation.w)
        assert a.twist.twist.linear.x == b.twist.twist.linear.x and a.child_frame_id == b.child_frame_id
    for a, b in zip(by_topic["/alpamayo/trajectories"], got["/alpamayo/trajectories"]):
        assert a.selection_policy == b.selection_policy and list(a.scores) == list(b.scores)
        assert [p.position.x for p in a.samples[0].poses] == [p.position.x for p in b.samples[0].poses]


def test_clock_follows_bag_time(round_trip):
    src, out = round_trip
    clocks = [stamp_to_ns(m.msg.clock) for m in read_messages(out, topics=["/clock"])]
    assert clocks == sorted(clocks)
    log_times = [m.log_time_ns for m in read_messages(src)]
    assert clocks[0] >= min(log_times) - 1 and clocks[-1] == max(log_times)


def test_recording_is_standard_mcap(round_trip):
    _, out = round_trip
    (mcap_file,) = out.glob("*.mcap")
    with open(mcap_file, "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        decoded = [(c.topic, m) for _, c, _, m in reader.iter_decoded_messages(topics=["/odom", "/alpamayo/trajectories"])]
    assert {t for t, _ in decoded} == {"/odom", "/alpamayo/trajectories"}
    assert [m.selection_policy for t, m in decoded if t == "/alpamayo/trajectories"] == ["first", "first"]


def test_sim_time_recorder_keeps_the_first_messages_of_a_replay(tmp_path):
    """With use_sim_time the recorder discovers topics before /clock flows, so the route that
    opens the replay is recorded (stamped at the first clock time), not lost."""
    src, out = tmp_path / "src", tmp_path / "rec"
    with BagWriter(src, storage="mcap") as w:
        w.write("/navigation/instruction", "std_msgs/msg/String", T0, w.typestore.types["std_msgs/msg/String"](data="Turn left"))
        for i in range(1, 21):
            t = T0 + i * 20_000_000
            w.write("/odom", "nav_msgs/msg/Odometry", t, w.odometry(t, (0.2 * i, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0)))
    env = ros_env(unique_domain_id())
    rec_log = tmp_path / "record.log"
    with open(rec_log, "wb") as log:
        rec = subprocess.Popen([str(VENV_BIN / "alpamayo-record"), "--topics", "/navigation/instruction", "/odom",
                                "--out", str(out), "--ros-args", "-p", "use_sim_time:=true"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        output = replay(src, env, rec_log, "--wait-timeout", "60", timeout_s=120)
        assert "no subscriber" not in output, rec_log.read_text()  # the recorder was listening before /clock
    finally:
        code = stop_process(rec, timeout_s=30)
    assert code == 0, rec_log.read_text()
    assert bag_topics(out) == bag_topics(src)
    (route,) = read_messages(out, topics=["/navigation/instruction"])
    assert route.msg.data == "Turn left" and T0 <= route.log_time_ns <= T0 + 20 * 20_000_000
