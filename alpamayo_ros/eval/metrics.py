"""Trajectory error metrics, defined as upstream's inference test defines them.

ADE is the mean over the 64 waypoints of the xy L2 error, FDE the xy error at the last one;
over several samples the test reports the best sample (minADE). z is ignored because the
model's z is only the last history height repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np


@dataclass(frozen=True)
class PlanScore:
    """Errors of every sample of one plan against one recorded future.

    ade/fde: (samples,) metres.
    """

    ade: np.ndarray
    fde: np.ndarray

    @property
    def min_ade(self) -> float:
        return float(self.ade.min())

    @property
    def mean_ade(self) -> float:
        return float(self.ade.mean())

    @property
    def min_fde(self) -> float:
        return float(self.fde.min())

    @property
    def best_sample(self) -> int:
        """Index of the sample with the lowest ADE (the one minADE reports)."""
        return int(self.ade.argmin())


def displacement_errors(pred_xyz: np.ndarray, true_xyz: np.ndarray) -> np.ndarray:
    """xy L2 error per sample and waypoint, (samples, T).

    pred_xyz: (samples, T, 2 or 3) or (T, 2 or 3); true_xyz: (T, 2 or 3), same frame.
    """
    pred = np.asarray(pred_xyz, dtype=np.float64)
    true = np.asarray(true_xyz, dtype=np.float64)
    if pred.ndim == 2:
        pred = pred[None]
    if pred.ndim != 3 or pred.shape[-1] < 2:
        raise ValueError(f"pred_xyz: expected (samples, T, 2|3), got {np.shape(pred_xyz)}")
    if true.ndim != 2 or true.shape[-1] < 2:
        raise ValueError(f"true_xyz: expected (T, 2|3), got {np.shape(true_xyz)}")
    if pred.shape[1] != true.shape[0] or pred.shape[1] == 0:
        raise ValueError(f"true_xyz: {true.shape[0]} waypoints for predictions with {pred.shape[1]}")
    if not (np.isfinite(pred[..., :2]).all() and np.isfinite(true[:, :2]).all()):
        raise ValueError("pred_xyz/true_xyz: non-finite xy values")
    return np.linalg.norm(pred[..., :2] - true[None, :, :2], axis=-1)


def score_plan(pred_xyz: np.ndarray, true_xyz: np.ndarray) -> PlanScore:
    """ADE and FDE of every sample of pred_xyz against true_xyz."""
    err = displacement_errors(pred_xyz, true_xyz)
    return PlanScore(ade=err.mean(axis=1), fde=err[:, -1])


def summarize(scores: Iterable[PlanScore]) -> dict[str, float | int]:
    """Aggregate per-t0 scores: mean, median and p90 of minADE, plus means of meanADE and minFDE.

    Every t0 weighs the same, as in a per-clip benchmark table. Empty input gives count 0 and
    NaN statistics so a report can still be written for a bag where every tick was skipped.
    """
    scores = list(scores)
    if not scores:
        nan = float("nan")
        return {"count": 0, "min_ade_mean": nan, "min_ade_median": nan, "min_ade_p90": nan,
                "mean_ade_mean": nan, "min_fde_mean": nan, "min_fde_median": nan}
    min_ade = np.array([s.min_ade for s in scores])
    min_fde = np.array([s.min_fde for s in scores])
    return {
        "count": len(scores),
        "min_ade_mean": float(min_ade.mean()),
        "min_ade_median": float(np.median(min_ade)),
        "min_ade_p90": float(np.percentile(min_ade, 90)),
        "mean_ade_mean": float(np.mean([s.mean_ade for s in scores])),
        "min_fde_mean": float(min_fde.mean()),
        "min_fde_median": float(np.median(min_fde)),
    }
