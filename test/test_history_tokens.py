"""Delta history tokenizer against bins computed by hand."""

import pytest
import torch

from alpamayo_ros.core.history_tokens import DeltaHistoryTokenizer


def bins_of(deltas):
    """Positions whose consecutive deltas (first from the origin) are `deltas`."""
    return torch.cumsum(torch.tensor(deltas, dtype=torch.float32), dim=0)


def test_hand_computed_bins():
    tokenizer = DeltaHistoryTokenizer()
    xyz = bins_of([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [4.0, -4.0, 10.0]])
    # bin = round((d - min) / (max - min) * 999):
    #   0 on x/y: 0.5 * 999 = 499.5 -> 500 (half to even); 0 on z: likewise 500.
    #   x 1.0 -> 0.625 * 999 = 624.375 -> 624; y -2.0 -> 0.25 * 999 = 249.75 -> 250;
    #   z 0.5 -> 0.525 * 999 = 524.475 -> 524; the range ends map to 999 and 0.
    expected = [500, 500, 500, 624, 250, 524, 999, 0, 999]
    assert tokenizer.encode(xyz).tolist() == expected


def test_out_of_range_deltas_clamp():
    tokenizer = DeltaHistoryTokenizer()
    xyz = bins_of([[5.0, -4.5, 30.0], [-100.0, 100.0, -10.5]])
    assert tokenizer.encode(xyz).tolist() == [999, 0, 999, 0, 999, 0]


def test_first_delta_is_the_oldest_pose_itself():
    # A 10 m/s history: the oldest pose is 15 m behind t0, far below the -4 m bin range,
    # so the first x token saturates at 0 (upstream behaviour); later steps are 1 m.
    tokenizer = DeltaHistoryTokenizer()
    x = torch.arange(-15, 1, dtype=torch.float32)
    xyz = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=-1)
    tokens = tokenizer.encode(xyz)
    assert tokens.shape == (48,) and tokens.dtype == torch.int64
    assert tokens[:3].tolist() == [0, 500, 500]
    assert tokens[3:].view(15, 3).tolist() == [[624, 500, 500]] * 15


def test_batched_layout_and_custom_range():
    tokenizer = DeltaHistoryTokenizer(num_bins=11, xyz_min=(-1, -1, -1), xyz_max=(1, 1, 1))
    xyz = torch.zeros(2, 3, 16, 3)
    xyz[1, 2, 0] = torch.tensor([0.2, -0.6, 1.0])  # first delta of one row only
    tokens = tokenizer.encode(xyz)
    assert tokens.shape == (2, 3, 48)
    # (0.2 + 1) / 2 * 10 = 6; (-0.6 + 1) / 2 * 10 = 2; 1.0 -> 10; the next delta undoes it.
    assert tokens[1, 2, :6].tolist() == [6, 2, 10, 4, 8, 0]
    assert (tokens[0] == 5).all() and (tokens[1, 2, 6:] == 5).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_bins"):
        DeltaHistoryTokenizer(num_bins=1)
    with pytest.raises(ValueError, match="xyz_min"):
        DeltaHistoryTokenizer(xyz_min=(4, -4, -10), xyz_max=(-4, 4, 10))
    with pytest.raises(ValueError, match="hist_xyz"):
        DeltaHistoryTokenizer().encode(torch.zeros(16, 2))
    with pytest.raises(ValueError, match="hist_xyz"):
        DeltaHistoryTokenizer().encode(torch.zeros(16, 3, dtype=torch.int64))
