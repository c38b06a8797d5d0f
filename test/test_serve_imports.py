"""The server and its client run without ROS: no module of alpamayo_ros.serve loads rclpy."""

from test_import_boundaries import imported_after, modules_of


def test_serve_package_does_not_import_ros() -> None:
    modules = [name for name in modules_of("serve") if not name.endswith("__main__")]  # __main__ runs the server
    loaded = imported_after(modules)
    assert {"fastapi", "torch", "msgspec"} <= loaded  # the check really imported the server
    assert not {"rclpy", "rcl_interfaces", "alpamayo_ros_msgs"} & loaded
