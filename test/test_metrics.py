"""ADE/FDE on paths whose errors are known in closed form."""

import math

import numpy as np
import pytest

from alpamayo_ros.eval.metrics import displacement_errors, score_plan, summarize

T = 64


def _arc(radius: float, speed: float) -> np.ndarray:
    """Waypoints at t=0.1..6.4 s on a left circle through the origin, heading +x."""
    t = np.arange(1, T + 1) * 0.1
    phi = speed * t / radius
    return np.stack([radius * np.sin(phi), radius * (1 - np.cos(phi)), np.zeros(T)], axis=-1)


def test_identical_paths_have_zero_error():
    path = _arc(30.0, 8.0)
    score = score_plan(path[None], path)
    assert score.min_ade == pytest.approx(0.0, abs=1e-12)
    assert score.min_fde == pytest.approx(0.0, abs=1e-12)


def test_constant_lateral_offset_gives_offset():
    path = _arc(30.0, 8.0)
    shifted = path + np.array([0.0, 1.5, 0.0])
    score = score_plan(shifted[None], path)
    assert score.min_ade == pytest.approx(1.5)
    assert score.min_fde == pytest.approx(1.5)


def test_z_is_ignored():
    path = _arc(30.0, 8.0)
    lifted = path + np.array([0.0, 0.0, 5.0])
    assert score_plan(lifted[None], path).min_ade == pytest.approx(0.0, abs=1e-12)


def test_rotation_about_origin_error_grows_with_distance():
    # A path rotated by angle a about the origin is off by 2*r*sin(a/2) at range r.
    t = np.arange(1, T + 1) * 0.1
    straight = np.stack([10.0 * t, np.zeros(T), np.zeros(T)], axis=-1)
    a = math.radians(10.0)
    rot = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]])
    rotated = straight @ rot.T
    expected = 2 * 10.0 * t * math.sin(a / 2)
    score = score_plan(rotated[None], straight)
    assert score.min_ade == pytest.approx(expected.mean())
    assert score.min_fde == pytest.approx(expected[-1])


def test_speed_error_along_track():
    # Same line, 10 % faster: error at time t is 0.1 * v * t.
    t = np.arange(1, T + 1) * 0.1
    slow = np.stack([8.0 * t, np.zeros(T), np.zeros(T)], axis=-1)
    fast = np.stack([8.8 * t, np.zeros(T), np.zeros(T)], axis=-1)
    score = score_plan(fast[None], slow)
    assert score.min_ade == pytest.approx(0.8 * t.mean())
    assert score.min_fde == pytest.approx(0.8 * 6.4)


def test_min_and_mean_over_samples():
    path = _arc(50.0, 5.0)
    offsets = np.array([3.0, 0.5, 2.0])
    samples = np.stack([path + np.array([0.0, o, 0.0]) for o in offsets])
    score = score_plan(samples, path)
    np.testing.assert_allclose(score.ade, offsets)
    assert score.min_ade == pytest.approx(0.5)
    assert score.mean_ade == pytest.approx(offsets.mean())
    assert score.best_sample == 1
    assert score.min_fde == pytest.approx(0.5)


def test_min_fde_can_come_from_another_sample_than_min_ade():
    path = np.zeros((T, 3))
    a = np.zeros((T, 3))
    a[:, 1] = 1.0
    a[-1, 1] = 5.0  # low ADE, high FDE
    b = np.zeros((T, 3))
    b[:, 1] = 2.0  # higher ADE, lower FDE
    score = score_plan(np.stack([a, b]), path)
    assert score.best_sample == 0
    assert score.min_fde == pytest.approx(2.0)


def test_summary_aggregates_per_t0():
    path = np.zeros((T, 3))
    scores = [score_plan((path + np.array([0.0, o, 0.0]))[None], path) for o in (1.0, 2.0, 3.0, 10.0)]
    s = summarize(scores)
    assert s["count"] == 4
    assert s["min_ade_mean"] == pytest.approx(4.0)
    assert s["min_ade_median"] == pytest.approx(2.5)
    assert s["min_ade_p90"] == pytest.approx(np.percentile([1, 2, 3, 10], 90))
    assert s["min_fde_mean"] == pytest.approx(4.0)


def test_summary_of_nothing_is_nan_not_an_error():
    s = summarize([])
    assert s["count"] == 0 and math.isnan(s["min_ade_mean"])


def test_bad_shapes_name_the_input():
    with pytest.raises(ValueError, match="true_xyz"):
        displacement_errors(np.zeros((1, T, 3)), np.zeros((T - 1, 3)))
    with pytest.raises(ValueError, match="pred_xyz"):
        displacement_errors(np.zeros((1, 2, T, 3)), np.zeros((T, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        displacement_errors(np.full((1, T, 3), np.nan), np.zeros((T, 3)))
