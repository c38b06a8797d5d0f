"""The ROS 2 front end: the alpamayo_drive node, its console script, parameters, QoS, outputs,
diagnostics and message conversion.

It turns ROS messages into plain ones for the drive loop (alpamayo_ros/drive/) and publishes
what the loop decides. Together with the ROS programs (rostools/) and the test rig (testing/),
the only code that imports rclpy; it holds no model math (the pipeline is imported lazily by the
node's worker thread, so importing this package does not pull in torch).
"""
