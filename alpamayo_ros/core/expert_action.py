"""The expert's input side: the noisy action and its flow time embedded as one token per
waypoint (upstream's `action_in_proj`), and the RMS norm the whole expert uses."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ACTION_DIM = 2  # normalised (acceleration, curvature) per waypoint
_ACTION_RMS_EPS = 1e-5  # fixed in upstream's action_in_proj encoder


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 and cast back, as both Qwen3 and upstream's encoder do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm upcasts half inputs to fp32 and casts the result back: the same math as
        # the spelled-out version, in one fused kernel on CUDA.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class FourierFeatures(nn.Module):
    """sqrt(2) [sin, cos](2 pi x f) for log-spaced f in [1, max_freq]; no weights.

    The frequencies are an unsaved buffer, so casting the module to bf16 rounds them (1.6681
    becomes 1.671875), exactly as upstream's bf16 load does; the product is still fp32.
    """

    def __init__(self, *, num_feats: int, max_freq: float) -> None:
        super().__init__()
        freqs = torch.logspace(0.0, math.log10(max_freq), num_feats // 2)
        self.freqs = nn.Buffer(freqs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encode x (...) in fp32 -> (..., num_feats)."""
        angle = x.float()[..., None] * self.freqs.float() * 2 * math.pi
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1) * math.sqrt(2)


class ActionEncoder(nn.Module):
    """MLP: Linear, SiLU, (num_layers - 1) x [RMSNorm, Linear, SiLU], RMSNorm, Linear."""

    def __init__(self, *, in_dim: int, hidden: int, out_dim: int, num_layers: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_dim, hidden), nn.SiLU()]
        for _ in range(num_layers - 1):
            layers += [RMSNorm(hidden, _ACTION_RMS_EPS), nn.Linear(hidden, hidden), nn.SiLU()]
        layers += [RMSNorm(hidden, _ACTION_RMS_EPS), nn.Linear(hidden, out_dim)]
        self.trunk = nn.Sequential(*layers)  # indices match upstream's trunk.{0..12} keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)


class ActionInProjection(nn.Module):
    """Embed a noisy action and its flow time as one expert input token per waypoint."""

    def __init__(
        self, *, num_fourier_feats: int, max_freq: float, action_hidden_size: int, hidden_size: int,
        num_enc_layers: int,
    ) -> None:
        super().__init__()
        self.fourier = FourierFeatures(num_feats=num_fourier_feats, max_freq=max_freq)
        in_dim = (ACTION_DIM + 1) * num_fourier_feats  # accel, curvature, t
        self.encoder = ActionEncoder(
            in_dim=in_dim, hidden=action_hidden_size, out_dim=hidden_size, num_layers=num_enc_layers
        )
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Map x (N, W, 2) and t (N,) to embeddings (N, W, hidden) in the weights' dtype."""
        n_rows, n_waypoints, _ = x.shape
        time_feats = self.fourier(t)[:, None, :].expand(n_rows, n_waypoints, -1)
        feats = torch.cat([self.fourier(x[..., 0]), self.fourier(x[..., 1]), time_feats], dim=-1)
        weight = self.encoder.trunk[0].weight
        return self.norm(self.encoder(feats.to(weight.dtype)))
