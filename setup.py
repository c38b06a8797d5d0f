"""ament_python package: works with `colcon build` on a ROS 2 install and with `pip install -e .`."""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "alpamayo_ros"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    package_data={PACKAGE: ["core/data/*.json"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*")),
    ],
    install_requires=["setuptools"],
    zip_safe=False,
    maintainer="alpamayo_ros maintainers",
    maintainer_email="maintainers@alpamayo-ros.invalid",
    description="ROS 2 driving planner node for NVIDIA Alpamayo 1.5 (HF and in-process vLLM backends).",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            "alpamayo_drive = alpamayo_ros.ros.process:main",
            "alpamayo-eval = alpamayo_ros.eval.cli:main",
            "alpamayo-replay = alpamayo_ros.rostools.replay:main",
            "alpamayo-record = alpamayo_ros.rostools.record:main",
            "alpamayo-demo = alpamayo_ros.rostools.demo:main",
            "alpamayo-convert-pai = alpamayo_ros.eval.physical_ai_av:main",
            "alpamayo-make-checkpoint = alpamayo_ros.core.tiny_checkpoint:main",
            "alpamayo-serve = alpamayo_ros.serve.cli:main",
            "alpamayo-egodriver = alpamayo_ros.sim.cli:main",
            "alpamayo-sim-demo = alpamayo_ros.sim.demo:main",
        ],
    },
)
