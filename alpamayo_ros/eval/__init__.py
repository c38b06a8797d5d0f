"""The bag evaluator (minADE/FDE): its library (evaluate, jobs, fleet, report), its command line
(cli.py) and the PhysicalAI-AV conversion. ROS-free: bags are read with rosbags, not rclpy."""
