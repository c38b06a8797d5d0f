"""ROS child processes end cleanly on SIGINT and leave no shared-memory segments behind.

The suite ends every node this way (alpamayo_ros.rostools.processes.stop_process); this proves the mechanism:
two processes that really exchanged data over Fast DDS (shared-memory transport included) exit 0
and /dev/shm holds no new Fast DDS segment afterwards.
"""

from pathlib import Path

from alpamayo_ros.testing.rig import ros_env, start_python, stop_process, unique_domain_id, wait_until

FASTDDS_SHM_PREFIXES = ("fastdds_", "fastrtps_", "fast_datasharing_", "sem.fastdds_", "sem.fastrtps_")

def _node_script(name: str, body: str) -> str:
    """A one-node rclpy program: `body` sets up `node`, which spins until SIGINT."""
    return f"""
import pathlib
import rclpy
from rclpy.executors import ExternalShutdownException
from std_msgs.msg import String
rclpy.init()
node = rclpy.create_node({name!r})
{body}
try:
    rclpy.spin(node)
except (KeyboardInterrupt, ExternalShutdownException):
    pass
finally:
    node.destroy_node()
    rclpy.try_shutdown()
"""


TALKER = _node_script(
    "hygiene_talker",
    'pub = node.create_publisher(String, "/hygiene", 10)\n'
    'node.create_timer(0.05, lambda: pub.publish(String(data="x" * 100000)))',
)


def listener_script(mark: Path) -> str:
    """A node that writes the length of each message it gets into mark."""
    return _node_script(
        "hygiene_listener",
        f'node.create_subscription(String, "/hygiene", lambda m: pathlib.Path({str(mark)!r}).write_text(str(len(m.data))), 10)',
    )


def fastdds_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(FASTDDS_SHM_PREFIXES)}


def mapped_shm_names() -> set[str]:
    """Names under /dev/shm that some live process still maps (in use, not leaked)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        names.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in text.splitlines() if "/dev/shm/" in line)
    return names


def leaked_since(before: set[str]) -> set[str]:
    """New Fast DDS segments that no process maps: what a killed process leaves behind.

    Other tests' live processes may create segments meanwhile; those are mapped, so not counted.
    """
    return fastdds_segments() - before - mapped_shm_names()


def test_sigint_ends_ros_processes_cleanly_without_shm_leftovers(tmp_path: Path) -> None:
    before = fastdds_segments()
    env = ros_env(unique_domain_id())
    mark = tmp_path / "received"
    talker = start_python(TALKER, env=env, log_path=tmp_path / "talker.log")
    listener = start_python(listener_script(mark), env=env, log_path=tmp_path / "listener.log")
    try:
        assert wait_until(mark.exists, timeout_s=30), (tmp_path / "listener.log").read_text()
        assert mark.read_text() == "100000"
    finally:
        codes = (stop_process(listener), stop_process(talker))
    assert codes == (0, 0), ((tmp_path / "talker.log").read_text(), (tmp_path / "listener.log").read_text())
    assert wait_until(lambda: not leaked_since(before), timeout_s=5), leaked_since(before)
