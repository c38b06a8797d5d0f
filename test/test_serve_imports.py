"""The server and its client run without ROS: no module of alpamayo_ros.serve loads rclpy."""

from test_import_boundaries import imported_after, modules_of


def test_serve_package_does_not_import_ros() -> None:
    modules = [name for name in modules_of("serve") if not name.endswith("__main__")]  # __main__ runs the server
    loaded = imported_after(modules)
    assert {"fastapi", "torch", "msgspec"} <= loaded  # the check really imported the server
    assert not {"rclpy", "rcl_interfaces", "alpamayo_ros_msgs"} & loaded


def test_node_settings_do_not_depend_on_the_server() -> None:
    """settings.py offers remote.frame_transport's choices without importing serve/ (the node's
    parameter table must not pull in the server package)."""
    from test_import_graph import package_graph

    graph = package_graph()
    assert "alpamayo_ros.frame_transport" in graph["alpamayo_ros.settings"]
    assert not any(target.startswith("alpamayo_ros.serve") for target in graph["alpamayo_ros.settings"])
