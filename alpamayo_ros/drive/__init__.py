"""The drive loop without ROS: what the node, the bag evaluator and every other front door share.

The scheduler (which input to plan, and when), the planner port (the in-process model or an
alpamayo-serve server), the inference worker thread and the output gate. Nothing here imports
rclpy: a front door turns its own messages into plain ones and publishes what comes out.
"""
