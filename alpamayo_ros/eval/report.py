"""Evaluation output: report.json, report.md and PNG plots (matplotlib Agg, no display needed).

Each planned tick's row (TickResult.to_json) carries its plan's speculation counts; the report
sums them per bag and over all bags, with the acceptance rate (speculation_summary).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from alpamayo_ros.eval.metrics import summarize  # noqa: E402

if TYPE_CHECKING:
    from alpamayo_ros.core.types import Plan
    from alpamayo_ros.eval.evaluate import BagResult
    from alpamayo_ros.settings import DriveSettings

NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class CameraProjection:
    """A level pinhole camera on the ego vehicle, enough to draw a flat-ground path into its image.

    fx, fy, cx, cy: intrinsics (pixels) for an image of width x height.
    x_m, y_m, z_m, yaw: mount in the ego frame (x forward, y left, z up; yaw left positive).
    """

    fx: float
    fy: float
    cx: float
    cy: float
    width: int
    height: int
    x_m: float = 1.5
    y_m: float = 0.0
    z_m: float = 1.5
    yaw: float = 0.0

    def scaled_to(self, width: int, height: int) -> CameraProjection:
        """The same camera for an image resized to width x height."""
        sx, sy = width / self.width, height / self.height
        return CameraProjection(self.fx * sx, self.fy * sy, self.cx * sx, self.cy * sy, width, height,
                                self.x_m, self.y_m, self.z_m, self.yaw)

    def project(self, xyz_ego: np.ndarray) -> np.ndarray:
        """Ego-frame points (N, 3) -> pixel coordinates (M, 2) of those in front of the camera."""
        d = np.asarray(xyz_ego, dtype=np.float64)[:, :3] - [self.x_m, self.y_m, self.z_m]
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        forward, left = d[:, 0] * c + d[:, 1] * s, -d[:, 0] * s + d[:, 1] * c
        keep = forward > 0.5
        u = self.fx * -left[keep] / forward[keep] + self.cx
        v = self.fy * -d[keep, 2] / forward[keep] + self.cy
        return np.stack([u, v], -1)


def _json_safe(value: Any) -> Any:
    """NaN/inf -> None (strict JSON), numpy scalars/arrays -> Python."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def speculation_summary(plans: Sequence[Plan]) -> dict[str, Any]:
    """Draft tokens verified and accepted over these plans (vllm.speculation), and their ratio
    (None when nothing was drafted: speculation off, or no plan had history to draft from)."""
    drafted = sum(plan.drafted_tokens for plan in plans)
    accepted = sum(plan.accepted_tokens for plan in plans)
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def write_markdown(path: Path, report: dict[str, Any], notes: Sequence[str] = ()) -> None:
    """Human summary: aggregate metrics, per-bag table, skip reasons, plots."""
    s = report["summary"]
    lines = ["# Alpamayo evaluation", ""]
    lines += [f"> {n}" for n in notes] + ([""] if notes else [])
    lines += [
        f"Checkpoint: `{report.get('checkpoint', 'n/a')}`, backend `{report.get('backend', 'n/a')}`, "
        f"planning rate {report['settings']['rate_hz']} Hz, {report['settings']['num_samples']} sample(s) per plan.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for key in ("count", "min_ade_mean", "min_ade_median", "min_ade_p90", "mean_ade_mean", "min_fde_mean", "min_fde_median"):
        lines.append(f"| {key} | {_fmt(s.get(key))} |")
    lines.append(f"| ticks | {report['ticks_total']} |")
    lines.append(f"| skipped share | {_fmt(report['skipped_share'])} |")
    if report.get("latency_ms"):
        lat = report["latency_ms"]
        lines.append(f"| plan latency mean / p90 / max (ms) | {_fmt(lat['mean'])} / {_fmt(lat['p90'])} / {_fmt(lat['max'])} |")
    spec = report["speculation"]
    if spec["drafted_tokens"]:
        lines.append(f"| speculation: accepted / drafted tokens (rate) | {spec['accepted_tokens']} / "
                     f"{spec['drafted_tokens']} ({_fmt(spec['acceptance_rate'])}) |")
    lines += ["", "## Bags", "", "| bag | ticks | planned | minADE mean (m) | minFDE mean (m) |", "|---|---|---|---|---|"]
    for bag in report["bags"]:
        bs = bag["summary"]
        lines.append(f"| `{bag['bag']}` | {bag['ticks_total']} | {bs['count']} | {_fmt(bs['min_ade_mean'])} | {_fmt(bs['min_fde_mean'])} |")
    jumps = {b["bag"]: b["timeline_jumps"] for b in report["bags"] if b.get("timeline_jumps")}
    if jumps:
        lines += ["", "**Odometry stamps jump back** (loop or reset) in " + ", ".join(f"`{b}` ({n}x)" for b, n in jumps.items())
                  + ": ground truth is taken within one timeline; ticks whose future crosses a jump are skipped."]
    refused = {b["bag"]: b["refused_routes"] for b in report["bags"] if b.get("refused_routes")}
    if refused:
        lines += ["", "Routes refused at arrival (planned without them): "
                  + ", ".join(f"`{b}` {r}" for b, r in refused.items())]
    if report.get("failed"):
        lines += ["", "## Failed bags", "", "| bag | attempts | error |", "|---|---|---|"]
        lines += [f"| `{f['bag']}` | {f['attempts']} | {f['error']} |" for f in report["failed"]]
    if report.get("interrupted"):
        lines += ["", f"**Interrupted**: not evaluated: {', '.join(report.get('unfinished', [])) or 'none'}."]
    if report.get("workers"):
        lines += ["", "## Ray workers", "", f"Worker deaths retried on another worker: {report.get('worker_deaths_retried', 0)}.",
                  "", "| worker | host | pids | bags | plans | busy (s) | plans/s | deaths |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {w['worker']} | {w['host']} | {', '.join(map(str, w['pids']))}"
                  f"{' (replacement starting)' if w.get('replacement_starting') else ''} | {w['bags']} | {w['plans']} | "
                  f"{_fmt(w['busy_s'])} | {_fmt(w['plans_per_s'])} | {w['deaths']} |" for w in report["workers"]]
    if report["skipped"]:
        lines += ["", "## Skipped ticks", "", "| reason | count |", "|---|---|"]
        lines += [f"| {reason} | {count} |" for reason, count in sorted(report["skipped"].items())]
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report["plots"]]
    path.write_text("\n".join(lines) + "\n")


def plot_bev(path: Path, history_xyz: np.ndarray, pred_xyz: np.ndarray, true_xyz: np.ndarray | None,
             title: str, best_sample: int | None = None) -> None:
    """Bird's-eye view in the t0 ego frame: x forward drawn up, y left drawn left."""
    fig, ax = plt.subplots(figsize=(4.5, 6), dpi=100)
    ax.plot(-history_xyz[:, 1], history_xyz[:, 0], "k.-", lw=1, ms=3, label="history")
    for k, sample in enumerate(pred_xyz):
        best = k == best_sample
        ax.plot(-sample[:, 1], sample[:, 0], "-", color="tab:red" if best else "tab:orange",
                lw=2 if best else 1, alpha=1.0 if best else 0.6, label="predicted" if k == 0 else None)
    if true_xyz is not None:
        ax.plot(-true_xyz[:, 1], true_xyz[:, 0], "-", color="tab:blue", lw=2, label="recorded")
    ax.plot([0], [0], "k^", ms=8)
    ax.set_xlabel("lateral (m, left <)")
    ax.set_ylabel("forward (m)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_metrics(path: Path, t_s: Sequence[float], min_ade: Sequence[float], min_fde: Sequence[float]) -> None:
    """minADE and minFDE per planned t0 (seconds from the bag start)."""
    fig, ax = plt.subplots(figsize=(7, 3), dpi=100)
    ax.plot(t_s, min_ade, "o-", ms=3, label="minADE")
    ax.plot(t_s, min_fde, "s-", ms=3, label="minFDE")
    ax.set_xlabel("t0 (s from bag start)")
    ax.set_ylabel("error (m)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_camera(path: Path, image: np.ndarray, camera: CameraProjection, pred_xyz: np.ndarray,
                true_xyz: np.ndarray | None, title: str) -> None:
    """The t0 camera frame with predicted (red/orange) and recorded (blue) paths drawn on the ground."""
    cam = camera.scaled_to(image.shape[1], image.shape[0])
    fig, ax = plt.subplots(figsize=(6.0, 6.0 * image.shape[0] / image.shape[1] + 0.4), dpi=100)
    ax.imshow(image)
    for k, sample in enumerate(pred_xyz):
        uv = cam.project(np.column_stack([sample[:, :2], np.zeros(len(sample))]))
        ax.plot(uv[:, 0], uv[:, 1], "-", color="tab:red" if k == 0 else "tab:orange", lw=2)
    if true_xyz is not None:
        uv = cam.project(np.column_stack([true_xyz[:, :2], np.zeros(len(true_xyz))]))
        ax.plot(uv[:, 0], uv[:, 1], "-", color="tab:blue", lw=2)
    ax.set_xlim(0, image.shape[1])
    ax.set_ylim(image.shape[0], 0)
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_drive_map(path: Path, centerline: np.ndarray, lane_width_m: float, driven_xy: np.ndarray,
                   plans_xy: Sequence[np.ndarray]) -> None:
    """World map of a closed-loop drive: road, the path driven and every plan followed."""
    fig, ax = plt.subplots(figsize=(7, 7), dpi=100)
    lo = driven_xy.min(0) - 40 if len(driven_xy) else centerline.min(0)
    hi = driven_xy.max(0) + 40 if len(driven_xy) else centerline.max(0)
    near = np.all((centerline >= lo) & (centerline <= hi), axis=1)
    heading = np.arctan2(np.gradient(centerline[:, 1]), np.gradient(centerline[:, 0]))
    normal = np.stack([-np.sin(heading), np.cos(heading)], -1)
    for offset, style in ((lane_width_m, "k-"), (0.0, "k--"), (-lane_width_m, "k-")):
        edge = np.where(near[:, None], centerline + offset * normal, np.nan)
        ax.plot(edge[:, 0], edge[:, 1], style, lw=0.8, alpha=0.6)
    for k, plan in enumerate(plans_xy):
        ax.plot(plan[:, 0], plan[:, 1], "-", color="tab:orange", lw=0.8, alpha=0.7, label="plans" if k == 0 else None)
    if len(driven_xy):
        ax.plot(driven_xy[:, 0], driven_xy[:, 1], "-", color="tab:blue", lw=2, label="driven")
        ax.plot(*driven_xy[0], "go", label="start")
    ax.set_xlim(lo[0], hi[0])
    ax.set_ylim(lo[1], hi[1])
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel("x (m)")
    ax.set_ylabel("y (m)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("closed-loop drive (world frame)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclass(frozen=True)
class ReportOptions:
    """What to draw: BEV plots of this many ticks (spread over the bags) and, with a camera
    projection, that camera's t0 frame with the projected paths; extra_plots are PNGs the
    caller already wrote into the report directory."""

    bev_plots: int = 4
    camera: CameraProjection | None = None
    camera_index: int = 1
    notes: tuple[str, ...] = ()
    extra_plots: tuple[str, ...] = ()


def write_report(out: Path, results: Sequence[BagResult], settings: DriveSettings,
                 options: ReportOptions = ReportOptions(), meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json, report.md and PNG plots in out; returns the JSON document."""
    out.mkdir(parents=True, exist_ok=True)
    scored = [t for r in results for t in r.scored]
    skipped: Counter = Counter()
    for r in results:
        skipped.update(r.skipped())
    ticks_total = sum(len(r.ticks) for r in results)
    totals = [t.plan.timings_ms.get("total") for t in scored if t.plan is not None and "total" in t.plan.timings_ms]
    plots: list[str] = list(options.extra_plots)
    for k, r in enumerate(results):
        if r.scored:
            name = f"metrics_{k}_{r.bag.name}.png"
            plot_metrics(out / name, [(t.tick_ns - r.start_ns) / NS_PER_S for t in r.scored],
                         [t.score.min_ade for t in r.scored], [t.score.min_fde for t in r.scored])
            plots.append(name)
    picks = [scored[i] for i in sorted(set(np.linspace(0, len(scored) - 1, options.bev_plots).round().astype(int)))] \
        if scored and options.bev_plots > 0 else []
    for n, t in enumerate(picks):
        di, title = t.inputs, f"t0 {t.t0_ns / NS_PER_S:.2f} s  minADE {t.score.min_ade:.2f} m"
        plot_bev(out / f"bev_{n}.png", di.ego_history_xyz, t.plan.xyz, t.true_xyz, title, t.score.best_sample)
        plots.append(f"bev_{n}.png")
        if options.camera is not None and options.camera_index in di.camera_indices:
            image = di.images[di.camera_indices.index(options.camera_index), -1]
            plot_camera(out / f"camera_{n}.png", image, options.camera, t.plan.xyz, t.true_xyz, title)
            plots.append(f"camera_{n}.png")
    doc: dict[str, Any] = {
        **(meta or {}),
        "settings": {"rate_hz": 1.0 / settings.planning_period_s, "num_samples": settings.sampling.num_samples,
                     "cameras": {c.index: c.topic for c in settings.cameras}, "odometry_topic": settings.odometry_topic,
                     "image_size": settings.image_size, "sampling": vars(settings.sampling)},
        "summary": summarize(t.score for t in scored),
        "ticks_total": ticks_total,
        "skipped_share": (ticks_total - len(scored)) / ticks_total if ticks_total else float("nan"),
        "skipped": dict(skipped),
        "speculation": speculation_summary([t.plan for t in scored]),
        "latency_ms": ({"mean": float(np.mean(totals)), "p90": float(np.percentile(totals, 90)), "max": float(np.max(totals))}
                       if totals else None),
        "bags": [{"bag": str(r.bag), "ticks_total": len(r.ticks), "summary": summarize(t.score for t in r.scored),
                  "skipped": dict(r.skipped()), "dropped_images": r.dropped_images,
                  "refused_routes": r.refused_routes, "timeline_jumps": r.timeline_jumps,
                  "speculation": speculation_summary([t.plan for t in r.scored]),
                  "ticks": [t.to_json(r.start_ns) for t in r.ticks]} for r in results],
        "plots": plots,
    }
    write_json(out / "report.json", doc)
    write_markdown(out / "report.md", doc, options.notes)
    return doc
