"""The package's import structure, read from its own source with ast (nothing is imported):
only ros/, rostools/ and testing/ import rclpy or ROS message packages, and no module or folder
imports itself through others. The ROS-free folders are then imported for real, with rclpy and
the message packages made unimportable, so a lazy or indirect ROS import fails too.

Imports under `if TYPE_CHECKING:` are not edges: they exist for annotations and never run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import alpamayo_ros

PACKAGE_DIR = Path(alpamayo_ros.__file__).parent
ROS_FOLDERS = {"ros", "rostools", "testing"}  # the front end, the ROS programs, the test rig
ROS_FREE_FOLDERS = ("drive", "inputs", "core", "serve", "eval")
NOT_IMPORTED = {"alpamayo_ros.serve.__main__"}  # runs the server when imported


def is_ros_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in {"rclpy", "rosbag2_py", "launch", "launch_ros"} or top.endswith(("_msgs", "_interfaces"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(path: Path) -> set[str]:
    """Every module (and module.name) a file imports, anywhere in it, relative imports resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def package_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    files = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    return {module: {n for n in imported_names(path) if n in files and n != module} for module, path in files.items()}


def folder(module: str) -> str:
    """The top-level folder of a module (alpamayo_ros.drive.loop -> drive; settings stays settings)."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)) is not None:
            return cycle
    return None


def test_only_the_ros_folders_import_ros() -> None:
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = module_name(path)
        if module.count(".") >= 1 and folder(module) in ROS_FOLDERS:
            continue
        offenders += [f"{module} imports {name}" for name in sorted(imported_names(path)) if is_ros_module(name)]
    assert offenders == []
    ros_node = imported_names(PACKAGE_DIR / "ros" / "node.py")
    assert "rclpy.node" in ros_node  # the scan does see ROS imports where they are


def test_no_module_imports_itself_through_others() -> None:
    graph = package_graph()
    assert len(graph) > 80 and graph["alpamayo_ros.ros.node"] >= {"alpamayo_ros.drive.loop"}
    assert find_cycle(graph) is None


def test_no_folder_imports_itself_through_others() -> None:
    folders: dict[str, set[str]] = {}
    for module, targets in package_graph().items():
        if module == "alpamayo_ros":
            continue
        folders.setdefault(folder(module), set()).update(folder(t) for t in targets if folder(t) != folder(module))
    assert folders["ros"] >= {"drive", "settings"} and "ros" not in folders["drive"]
    assert find_cycle(folders) is None, folders


def test_the_cycle_finder_finds_a_circle() -> None:
    """The checks above can fail: a circle of three and a self-free chain."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


BLOCKER = """
import importlib, importlib.abc, json, sys

class NoRos(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in {"rclpy", "rosbag2_py", "launch", "launch_ros"} or top.endswith(("_msgs", "_interfaces")):
            raise ImportError(f"{name}: ROS is blocked in this check")
        return None

sys.meta_path.insert(0, NoRos())
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_ros_free_folders_import_without_ros() -> None:
    """drive/, inputs/, core/ (vLLM included: ~10 s), serve/, the evaluator and settings, imported
    with every ROS package unimportable."""
    modules = sorted(
        module_name(p) for top in ROS_FREE_FOLDERS for p in (PACKAGE_DIR / top).rglob("*.py")
    ) + ["alpamayo_ros.settings"]
    modules = [m for m in modules if m not in NOT_IMPORTED]
    assert {"alpamayo_ros.drive.loop", "alpamayo_ros.eval.cli", "alpamayo_ros.serve.client"} <= set(modules)
    result = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(modules)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert {"torch", "numpy"} <= loaded and not any(is_ros_module(name) for name in loaded)


def test_the_blocker_blocks_ros() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(["alpamayo_ros.ros.qos"])],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and "ROS is blocked in this check" in result.stderr
