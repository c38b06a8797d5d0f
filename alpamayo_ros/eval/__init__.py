"""Bag evaluation (minADE/FDE), replay and record, PhysicalAI-AV conversion and the closed-loop demo."""
