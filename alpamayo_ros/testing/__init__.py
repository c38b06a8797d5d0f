"""Test and benchmark support, not used by the node, the server or the evaluator: the sensor rig
that drives a real node process over ROS (rig.py) and a synthetic drive written as a bag."""
