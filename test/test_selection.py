"""drive/selection.py: the sample the node's Path and the egodriver's answer drive."""

from __future__ import annotations

import numpy as np
import pytest

from alpamayo_ros.drive.selection import select_sample


def straight(speed: float, lateral: float, n: int = 64) -> np.ndarray:
    steps = np.arange(1, n + 1, dtype=np.float64) * 0.1
    return np.stack([speed * steps, np.full(n, lateral), np.zeros(n)], axis=-1)


def test_sample_selection_policies() -> None:
    xyz = np.stack([straight(5.0, 3.0), straight(5.0, 0.2), straight(5.0, -0.1), straight(5.0, -0.3)])
    assert select_sample(xyz, "first")[0] == 0
    index, scores = select_sample(xyz, "medoid")
    assert index == 1 or index == 2
    assert scores[index] == scores.min() and scores[0] == scores.max()
    assert scores[1] == pytest.approx(2.8 + 0.3 + 0.5)  # summed lateral gaps to the others
    assert select_sample(xyz, "all")[0] == -1


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="policy: 'best' is not one of first, medoid, all"):
        select_sample(np.stack([straight(5.0, 0.0)]), "best")
