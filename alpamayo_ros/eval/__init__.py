"""Offline evaluation, bag tooling and the closed-loop demo (no rclpy at import time)."""
