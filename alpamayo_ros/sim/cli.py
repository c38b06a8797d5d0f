"""`alpamayo-egodriver`: serve AlpaSim's EgodriverService on the drive loop.

    alpamayo-egodriver --checkpoint CKPT [--backend hf|vllm] [--device cuda] [--params-file drive.yaml]
                       [--host 0.0.0.0] [--port 6789] [--camera LOGICAL_ID=INDEX ...] [-p NAME:=VALUE ...]
                       [--record DIR]

The node's parameters (params file, then -p) set frame selection, ego history, sampling and the
gate; --camera replaces cameras.topics/indices (AlpaSim's logical ids instead of topics). The
model loads and plans one warm-up input before the port opens; then one line on stdout says
`alpamayo-egodriver listening on HOST:PORT`. SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from concurrent import futures

import grpc
from carla_driver_interface.protocol import add_EgodriverServiceServicer_to_server, channel_options

from alpamayo_ros.eval.evaluate import settings_values
from alpamayo_ros.drive.planner import make_planner, warmup_input
from alpamayo_ros.settings import DriveSettings, ParameterError, parse_param_overrides, parse_settings
from alpamayo_ros.sim.record import SessionRecorder
from alpamayo_ros.sim.service import EgodriverService

logger = logging.getLogger("alpamayo_egodriver")

#: AlpaSim's Alpamayo 1.5 cameras (its wizard's driver=alpamayo1_5) -> the model's camera indices.
ALPASIM_CAMERAS = {
    "camera_cross_left_120fov": 0,
    "camera_front_wide_120fov": 1,
    "camera_cross_right_120fov": 2,
    "camera_front_tele_30fov": 6,
}
DEFAULT_PORT = 6789  # AlpaSim's external-driver examples use localhost:6789


def parse_camera_map(items: list[str] | None) -> dict[str, int]:
    """--camera ID=INDEX items (none: AlpaSim's defaults)."""
    if not items:
        return dict(ALPASIM_CAMERAS)
    mapping: dict[str, int] = {}
    for item in items:
        logical_id, sep, index = item.partition("=")
        if not sep or not logical_id or not index.strip().isdigit():
            raise ParameterError("--camera", f"{item!r} is not LOGICAL_ID=INDEX")
        mapping[logical_id] = int(index)
    return mapping


def egodriver_settings(args: argparse.Namespace, camera_map: dict[str, int]) -> DriveSettings:
    """The node's settings with the cameras keyed by AlpaSim logical id."""
    overrides = parse_param_overrides(args.param)
    given = {"model.checkpoint_path": args.checkpoint, "model.backend": args.backend, "model.device": args.device}
    overrides.update({name: value for name, value in given.items() if value is not None})
    overrides.update({"cameras.topics": list(camera_map),
                      "cameras.indices": list(camera_map.values()),
                      "cameras.transports": ["compressed"] * len(camera_map)})  # fmt: skip
    settings = parse_settings(settings_values(args.params_file, overrides))
    if settings.selection == "all":
        raise ParameterError("sampling.selection", "'all': AlpaSim drives one trajectory, choose first or medoid "
                             "(every sample goes out in debug_info.sampled_trajectories)")  # fmt: skip
    if settings.remote is not None:
        raise ParameterError("model.backend", "remote is not served here; run the model in this process (hf or vllm)")
    return settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alpamayo-egodriver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (else the params file's)")
    parser.add_argument("--backend", default=None, choices=("hf", "vllm"))
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    parser.add_argument("--params-file", default=None, help="the node's params YAML")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="a node parameter, value read as YAML (NAME=VALUE also works); repeat for more")
    parser.add_argument("--camera", action="append", metavar="LOGICAL_ID=INDEX",
                        help=f"AlpaSim camera -> model camera index, repeated (default: {ALPASIM_CAMERAS})")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for AlpaSim's containers)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--workers", type=int, default=16, help="gRPC handler threads")
    parser.add_argument("--record", default=None, metavar="DIR", help="record every drive() under DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        camera_map = parse_camera_map(args.camera)
        settings = egodriver_settings(args, camera_map)
    except (ParameterError, ValueError) as error:
        print(f"alpamayo-egodriver: {error}", file=sys.stderr)
        return 2
    logger.info("loading %s (%s on %s)", settings.checkpoint_path, settings.backend, settings.device)
    planner = make_planner(settings)
    planner.warm_up(warmup_input(settings), settings.sampling)
    recorder = SessionRecorder(args.record) if args.record else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers), options=channel_options())
    add_EgodriverServiceServicer_to_server(EgodriverService(settings, planner, camera_map, recorder), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        print(f"alpamayo-egodriver: cannot bind {args.host}:{args.port}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    print(f"alpamayo-egodriver listening on {args.host}:{port}", flush=True)
    stop.wait()
    logger.info("stopping")
    planner.cancel()
    server.stop(grace=1.0).wait()
    planner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
