"""The ROS 2 layer: the alpamayo_drive node, its parameters, QoS and message conversion.

Only this package imports rclpy; it holds no model math (the pipeline is imported lazily by
the node's worker thread, so importing this package does not pull in torch).
"""
