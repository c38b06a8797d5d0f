"""Ego-history tokenizer: 16 past positions -> 48 discrete bins for the prompt.

Upstream shows the backbone the history as quantised per-step displacements (dx, dy, dz),
not as text. The bins are offsets into the history token range; the prompt builder adds
the id of the first history token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DeltaHistoryTokenizer:
    """Quantise consecutive position deltas into num_bins uniform bins per axis.

    The first delta is the first pose itself (a zero point is prepended), so the tokens of
    T poses are [dx0, dy0, dz0, dx1, ...] (3*T values). Deltas outside [xyz_min, xyz_max]
    (metres) saturate at the first/last bin. No yaw, matching the released model.
    """

    def __init__(
        self,
        num_bins: int = 1000,
        xyz_min: Sequence[float] = (-4.0, -4.0, -10.0),
        xyz_max: Sequence[float] = (4.0, 4.0, 10.0),
    ) -> None:
        if num_bins < 2:
            raise ValueError(f"num_bins: must be >= 2, got {num_bins}")
        if len(xyz_min) != 3 or len(xyz_max) != 3:
            raise ValueError(f"xyz_min/xyz_max: expected 3 values each, got {xyz_min}, {xyz_max}")
        if not all(low < high for low, high in zip(xyz_min, xyz_max)):
            raise ValueError(f"xyz_min: must be below xyz_max per axis, {xyz_min} vs {xyz_max}")
        self.num_bins = num_bins
        self.xyz_min = tuple(float(v) for v in xyz_min)
        self.xyz_max = tuple(float(v) for v in xyz_max)

    def encode(self, hist_xyz: torch.Tensor) -> torch.Tensor:
        """Return int64 bins (..., 3*T) for positions hist_xyz (..., T, 3) in the t0 ego frame."""
        if hist_xyz.ndim < 2 or hist_xyz.shape[-1] != 3:
            raise ValueError(f"hist_xyz: expected (..., T, 3), got {tuple(hist_xyz.shape)}")
        if not hist_xyz.is_floating_point():
            raise ValueError(f"hist_xyz: expected a float tensor, got {hist_xyz.dtype}")
        low = torch.tensor(self.xyz_min, dtype=hist_xyz.dtype, device=hist_xyz.device)
        high = torch.tensor(self.xyz_max, dtype=hist_xyz.dtype, device=hist_xyz.device)
        padded = torch.nn.functional.pad(hist_xyz, (0, 0, 1, 0))  # zero point before pose 0
        delta = padded[..., 1:, :] - padded[..., :-1, :]  # (..., T, 3)
        unit = (delta - low) / (high - low)
        # torch.round is round-half-to-even, as upstream; clamp after rounding.
        bins = (unit * (self.num_bins - 1)).round().long().clamp(0, self.num_bins - 1)
        return bins.flatten(-2)
