"""`alpamayo-eval BAG... --checkpoint DIR`: offline, deterministic open-loop evaluation on rosbags.

The evaluator's command line; evaluate.py is its library.

Every input (parameters, bags, clips) is checked before a model loads; the jobs run in this
process or spread over Ray workers (fleet.py), and one report is written (report.py).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Sequence

from alpamayo_ros.eval.evaluate import load_pipeline, settings_values
from alpamayo_ros.eval.jobs import JobOptions, make_jobs, run_here
from alpamayo_ros.eval.report import CameraProjection, ReportOptions, write_report
from alpamayo_ros.settings import parse_settings

logger = logging.getLogger(__name__)


def _camera_arg(text: str) -> CameraProjection:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (6, 10):
        raise argparse.ArgumentTypeError("expected fx,fy,cx,cy,width,height[,x_m,y_m,z_m,yaw_rad]")
    return CameraProjection(parts[0], parts[1], parts[2], parts[3], int(parts[4]), int(parts[5]), *parts[6:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-eval", description=__doc__.splitlines()[0])
    parser.add_argument("bags", nargs="*", type=Path, help="rosbag2 directories (sqlite3 or MCAP)")
    parser.add_argument("--clips", type=Path, metavar="LIST", help="file of PhysicalAI-AV clip ids, one per line (with --pai-root)")
    parser.add_argument("--pai-root", type=Path, metavar="DIR", help="local PhysicalAI-AV copy the clips are converted from")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: model.checkpoint_path of --params-file)")
    parser.add_argument("--params-file", type=Path, help="the node's YAML (e.g. config/drive.yaml): topics, sync, sampling")
    parser.add_argument("--out", type=Path, default=Path("eval_out"), help="report directory")
    parser.add_argument("--rate", type=float, help="planning rate (Hz); default planning.rate_hz")
    parser.add_argument("--backend", choices=("hf", "vllm"), help="default model.backend")
    parser.add_argument("--device", help="default model.device")
    parser.add_argument("--camera-topics", nargs="+", help="cameras.topics (with --camera-indices)")
    parser.add_argument("--camera-indices", nargs="+", type=int, help="cameras.indices")
    parser.add_argument("--camera-transports", nargs="+", help="cameras.transports")
    parser.add_argument("--odometry-topic", help="odometry.topic")
    parser.add_argument("--num-samples", type=int, help="sampling.num_samples")
    parser.add_argument("--max-reasoning-tokens", type=int, help="sampling.max_reasoning_tokens")
    parser.add_argument("--max-ticks", type=int, help="stop each bag after this many ticks")
    parser.add_argument("--front-camera", type=_camera_arg,
                        help="fx,fy,cx,cy,width,height[,x_m,y_m,z_m,yaw] of camera index 1: draws the paths into it")
    parser.add_argument("--plans-topic", help="score the TrajectorySet plans recorded on this topic instead of running a model")
    parser.add_argument("--t0s-from", metavar="TOPIC",
                        help="run the model at the t0s of the plans recorded on TOPIC and report how far its plans differ")
    parser.add_argument("--ray", action="store_true", help="spread the bags over Ray workers (one model each)")
    parser.add_argument("--ray-address", metavar="auto|ADDRESS",
                        help="join a running Ray cluster (default: start a local instance for this run)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (with --ray)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each Ray worker reserves (with --ray)")
    parser.add_argument("--max-attempts", type=int, default=3, help="tries of a bag whose Ray worker dies (with --ray)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not args.bags and args.clips is None:
        parser.error("give BAG... and/or --clips LIST --pai-root DIR")
    if not args.ray and (args.ray_address or args.gpus_per_worker):
        parser.error("--ray-address/--gpus-per-worker need --ray")
    overrides = {
        "model.checkpoint_path": str(args.checkpoint) if args.checkpoint else None, "model.backend": args.backend,
        "model.device": args.device, "planning.rate_hz": args.rate, "cameras.topics": args.camera_topics,
        "cameras.indices": args.camera_indices, "odometry.topic": args.odometry_topic,
        "sampling.num_samples": args.num_samples, "sampling.max_reasoning_tokens": args.max_reasoning_tokens,
        "cameras.transports": args.camera_transports or (["compressed"] * len(args.camera_topics) if args.camera_topics else None),
    }
    try:  # every input is checked here, before a model loads
        values = settings_values(args.params_file, overrides)
        if not values["model.checkpoint_path"]:
            if not args.plans_topic:
                raise ValueError("--checkpoint: required (or model.checkpoint_path in --params-file, "
                                 "or score recorded plans with --plans-topic)")
            values["model.checkpoint_path"] = "none (recorded plans)"
        settings = parse_settings(values, check_paths=not args.plans_topic)
        jobs = make_jobs(args.bags, args.clips, args.pai_root)
    except ValueError as exc:
        parser.exit(2, f"alpamayo-eval: error: {exc}\n")
    options = JobOptions(max_ticks=args.max_ticks, plans_topic=args.plans_topic, t0s_from=args.t0s_from,
                         progress=not args.no_progress and not args.ray)
    if args.ray:
        from alpamayo_ros.eval.fleet import FleetOptions, run_on_ray  # Ray and torch: only when asked for

        fleet = FleetOptions(address=args.ray_address, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                             max_attempts=args.max_attempts, progress=not args.no_progress)
        try:
            summary = run_on_ray(jobs, values, options, fleet)
        except (RuntimeError, ValueError) as exc:
            parser.exit(1, f"alpamayo-eval: error: {exc}\n")
    else:
        summary = run_here(jobs, settings, options, load_pipeline)
    outcomes = [o for o in summary.outcomes if o is not None]
    meta: dict[str, Any] = {"checkpoint": settings.checkpoint_path if options.needs_model else None,
                            "backend": f"recorded plans on {args.plans_topic}" if args.plans_topic else settings.backend,
                            "failed": [f.to_json() for f in summary.failures], "interrupted": summary.interrupted,
                            "unfinished": summary.unfinished(jobs),
                            # time in jobs, model loads excluded: plans / busy_s is the throughput, as per Ray worker
                            "busy_s": round(sum(o.wall_s for o in outcomes), 3)}
    if args.ray:
        meta.update(workers=summary.workers, worker_deaths_retried=summary.retries)
    if args.t0s_from:
        differences = {t0: d for o in outcomes for t0, d in o.replan_differences.items()}
        meta["replan_max_difference_m"] = max(differences.values()) if differences else None
        meta["replan_compared"] = len(differences)
    doc = write_report(args.out, [o.result for o in outcomes], settings, ReportOptions(camera=args.front_camera), meta)
    s = doc["summary"]
    logger.info("minADE %.3f m (mean over %d plans), minFDE %.3f m, %.0f%% of %d ticks skipped %s; report in %s",
                s["min_ade_mean"], s["count"], s["min_fde_mean"], 100 * doc["skipped_share"], doc["ticks_total"],
                doc["skipped"], args.out)
    if summary.interrupted:
        raise SystemExit(130)
    if summary.failures:
        logger.error("%d bag(s) failed: %s", len(summary.failures), ", ".join(f.name for f in summary.failures))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
