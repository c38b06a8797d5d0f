"""Which of a plan's trajectory samples is driven (sampling.selection). ROS-free.

Apart from the message conversion because every front door that answers with one trajectory
(the node's Path, the egodriver's AlpaSim answer) must pick the same sample of the same plan.
"""

from __future__ import annotations

import numpy as np

from alpamayo_ros.settings import SELECTIONS


def select_sample(xyz: np.ndarray, policy: str) -> tuple[int, np.ndarray]:
    """(selected index, or -1 for 'all', and the per-sample score) for (S, N, 3) waypoints.

    score = summed mean xy distance to every other sample; the medoid has the smallest.
    """
    if policy not in SELECTIONS:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(SELECTIONS)}")
    xy = xyz[..., :2].astype(np.float64)
    pairwise = np.linalg.norm(xy[:, None] - xy[None, :], axis=-1).mean(axis=-1)  # (S, S)
    scores = pairwise.sum(axis=1)
    if policy == "medoid":
        return int(np.argmin(scores)), scores
    return (0 if policy == "first" else -1), scores
