"""ROS programs around the drive node: the closed-loop demo, bag record and replay, and the child
processes they start. Beside ros/, the only runtime code that imports rclpy."""
