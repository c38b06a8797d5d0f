"""ROS child processes end cleanly on SIGINT and leave no shared-memory segments behind.

The suite ends every node this way (alpamayo_ros.rostools.processes.stop_process); this proves the mechanism:
two processes that really exchanged data over Fast DDS (shared-memory transport included) exit 0
and /dev/shm keeps none of the Fast DDS files they used. The drive node's own Ctrl-C is quiet too:
it logs its shutdown while ROS is still up, so rcl never reports a log line it could not publish.

Which files are a process's own is read from the process while it runs, not from /dev/shm before
and after: the suite runs two test files at once, and another file's nodes create and remove
segments meanwhile. Not all of them show in /proc/PID/maps either: a port's lock file (`*_el`)
is only held open, and its named semaphore (`sem.*_mutex`) is mapped under a temporary name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from alpamayo_ros.serve.process import free_port  # the remote backend's server: down
from alpamayo_ros.testing.rig import (
    ros_env,
    start_console_script,
    start_python,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)

FASTDDS_SHM_PREFIXES = ("fastdds_", "fastrtps_", "fast_datasharing_", "sem.fastdds_", "sem.fastrtps_")
CLEANUP_TIMEOUT_S = 60.0  # a hang guard: a loaded machine may take long to end a peer still using a port
ROSOUT_FAILURE = "Failed to publish log message to rosout"


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


def _shm_in_use(pid: int) -> set[str]:
    """The /dev/shm names a live process maps or holds open (empty once it has ended)."""
    names = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/" in line:
                names.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                names.add(target.removeprefix("/dev/shm/").split()[0])
    except OSError:  # the process ended meanwhile, or is not ours to read
        pass
    return names


def _segment_of(name: str) -> str:
    """The segment a Fast DDS file belongs to: a port's lock file and semaphore go with the port."""
    if name.startswith("sem.") and name.endswith("_mutex"):
        return name.removeprefix("sem.").removesuffix("_mutex")
    return name.removesuffix("_el")


def fastdds_files_of(pids: list[int]) -> set[str]:
    """The Fast DDS files running processes use: what they map or hold open, and the semaphore
    of each port they map."""
    used = set().union(*(_shm_in_use(pid) for pid in pids))
    files = {name for name in used if name.startswith(FASTDDS_SHM_PREFIXES)}
    return files | {f"sem.{name}_mutex" for name in files if name.startswith("fastdds_port")}


def left_behind(files: set[str]) -> set[str]:
    """Those of files still in /dev/shm whose segment no live process uses: what an exit leaked.

    A port segment is shared by every participant that talks through it, and a port number is
    taken again once free, so one that another live process (a concurrent test's node) uses is
    not a leftover.
    """
    present = {name for name in files if Path("/dev/shm", name).exists()}
    if not present:
        return set()
    in_use = set()
    for proc in Path("/proc").glob("[0-9]*"):
        in_use |= _shm_in_use(int(proc.name))
    return {name for name in present if _segment_of(name) not in {_segment_of(n) for n in in_use}}


def test_sigint_ends_ros_processes_cleanly_without_shm_leftovers(tmp_path: Path) -> None:
    env = ros_env(unique_domain_id())
    mark = tmp_path / "received"
    talker = start_python(TALKER, env=env, log_path=tmp_path / "talker.log")
    listener = start_python(listener_script(mark), env=env, log_path=tmp_path / "listener.log")
    # a concurrent test's node (another domain) that starts meanwhile and outlives the check
    bystander = start_python(TALKER, env=ros_env(unique_domain_id()), log_path=tmp_path / "bystander.log")
    try:
        # write_text truncates before it writes: a read in between sees the file empty
        assert wait_until(lambda: mark.exists() and mark.read_text() != "", timeout_s=30), (
            (tmp_path / "listener.log").read_text()
        )
        assert mark.read_text() == "100000"
        files = fastdds_files_of([talker.pid, listener.pid])
        assert wait_until(lambda: bool(fastdds_files_of([bystander.pid])), timeout_s=30), "bystander: no Fast DDS"
    finally:
        codes = (stop_process(listener), stop_process(talker))
    try:
        assert codes == (0, 0), ((tmp_path / "talker.log").read_text(), (tmp_path / "listener.log").read_text())
        assert any(name.startswith("fastdds_port") for name in files), f"no shared-memory port: nothing checked {files}"
        assert wait_until(lambda: not left_behind(files), timeout_s=CLEANUP_TIMEOUT_S), left_behind(files)
    finally:
        assert stop_process(bystander) == 0, (tmp_path / "bystander.log").read_text()



@pytest.mark.parametrize("marker", ["importing the remote model stack", "ready: "], ids=["importing", "ready"])
def test_drive_node_ctrl_c_logs_no_rosout_failure(tmp_path: Path, marker: str) -> None:
    """The node logs "shutting down" after the signal: with ROS still up, so the line reaches
    /rosout instead of rcl's complaint that the publisher's context is invalid."""
    params = write_params_file(tmp_path / "drive.yaml", {
        "model.backend": "remote", "remote.url": f"http://127.0.0.1:{free_port()}",
    })  # fmt: skip
    log = tmp_path / "node.log"  # stdout and stderr
    process = start_console_script("alpamayo_drive", env=ros_env(unique_domain_id()), log_path=log, params_file=params)
    try:
        assert wait_until(lambda: marker in log.read_text() or process.poll() is not None, timeout_s=300)
        assert process.poll() is None, log.read_text()
    finally:
        code = stop_process(process, timeout_s=40)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "shutting down" in text, text[-3000:]
    assert ROSOUT_FAILURE not in text and "Traceback" not in text, text[-3000:]


STALLED_TEARDOWN = """
import ctypes, logging, threading
from alpamayo_ros.ros.teardown import TeardownGuard
logging.basicConfig(level=logging.INFO)
TeardownGuard("stalled tool", step="ROS teardown", code=%d).start(1.0)
%s  # a teardown that never returns
"""
#: how the teardown stalls: waiting with the interpreter lock free, or inside a C call that holds
#: it (as rclpy's calls into Fast DDS do), where no Python thread can run again
STALLS = {"lock free": "threading.Event().wait()", "lock held": "ctypes.PyDLL(None).sleep(600)"}


@pytest.mark.parametrize(("stall", "code"), [("lock free", 0), ("lock free", 1), ("lock held", 0), ("lock held", 3)])
def test_a_stalled_teardown_ends_the_process_with_its_code(tmp_path: Path, stall: str, code: int) -> None:
    """TeardownGuard (alpamayo_drive, bench_node's publisher, alpamayo-replay): the work is done,
    the teardown hangs, and the process still ends by itself with the code it earned (a node whose
    model failed to load exits 1) and every thread's stack; where Python can still run, the log
    names the program and the stalled step first. No DDS participant here: the one a real stall
    leaves behind would stay in /dev/shm."""
    log = tmp_path / "stalled.log"
    process = start_python(STALLED_TEARDOWN % (code, STALLS[stall]), env=ros_env(unique_domain_id()), log_path=log)
    try:
        assert wait_until(lambda: process.poll() is not None, timeout_s=CLEANUP_TIMEOUT_S), log.read_text()
    finally:
        returned = stop_process(process)
    text = log.read_text()
    assert returned == code, text
    assert 'File "<string>", line 6 in <module>' in text, text  # the main thread's stalled line
    named = "stalled tool: ROS teardown still running 1 s after the work was done; exiting anyway" in text
    assert named == (stall == "lock free"), text
