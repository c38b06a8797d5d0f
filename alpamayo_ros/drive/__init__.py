"""The drive loop without ROS: what the node, the bag evaluator and every other front door share.

`loop.DriveLoop` takes plain timestamped messages (`messages.py`) and ticks and returns one
outcome per tick; inside it are the scheduler (which input to plan, and when, with its
counters), the planner port (`planner.py`: the in-process model or an alpamayo-serve server)
and the output gate. The node runs the loop's requests in the inference worker thread
(`worker.py`). Nothing here imports rclpy: a front door turns its own messages into plain ones
and publishes what comes out; `selection.py` picks the sample it drives.
"""
