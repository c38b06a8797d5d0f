"""Layer boundaries: the model core and input assembly never import rclpy; the ROS layer never
imports the model math (torch and the pipeline load lazily in the node's worker)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import alpamayo_ros

PACKAGE_DIR = Path(alpamayo_ros.__file__).parent
MODEL_MODULES = ("torch", "transformers", "vllm", "safetensors")


def modules_of(subpackage: str) -> list[str]:
    names = [f"alpamayo_ros.{subpackage}"]
    names += [
        f"alpamayo_ros.{subpackage}.{info.name}" for info in pkgutil.iter_modules([str(PACKAGE_DIR / subpackage)])
    ]
    return names


def imported_after(modules: list[str]) -> set[str]:
    """Top-level package names in sys.modules of a fresh interpreter after importing modules."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_core_and_inputs_do_not_import_rclpy() -> None:
    loaded = imported_after(modules_of("core") + modules_of("inputs"))  # vLLM included: ~10 s
    assert {"torch", "vllm"} <= loaded  # the check really imported the model core
    assert not {"rclpy", "rcl_interfaces", "alpamayo_ros_msgs"} & loaded


def test_inputs_and_settings_are_light() -> None:
    """The evaluator, its workers and the server use inputs/ and the parameter table without torch or rclpy."""
    loaded = imported_after(modules_of("inputs") + ["alpamayo_ros.settings"])
    assert "numpy" in loaded
    assert not ({"rclpy", *MODEL_MODULES} & loaded)


def test_ros_layer_holds_no_model_math() -> None:
    loaded = imported_after(modules_of("ros"))
    assert "rclpy" in loaded
    assert not (set(MODEL_MODULES) & loaded)


def test_ros_layer_imports_the_pipeline_only_lazily() -> None:
    """Static check: no module-level import of torch or core model modules in alpamayo_ros/ros."""
    allowed_core = {"alpamayo_ros.core.types"}
    for path in sorted((PACKAGE_DIR / "ros").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; the worker imports the pipeline inside a method
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in MODEL_MODULES, f"{path.name} imports {name}"
                if name.startswith("alpamayo_ros.core"):
                    assert name in allowed_core, f"{path.name} imports {name} at module level"
