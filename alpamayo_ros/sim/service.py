"""The EgodriverService servicer: sessions by uuid, one shared planner, errors that name the field.

A refused call changes nothing, in its own session or any other; calls of one session are
serialised by its lock, sessions plan one at a time on the shared model (the planner lock).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc
from carla_driver_interface.contract import METADATA_KEY
from carla_driver_interface.protocol import (ALPASIM_API_VERSION, DriveRequest, DriveResponse, DriveSessionCloseRequest,
                                             DriveSessionRequest, EgodriverServiceServicer, Empty, GroundTruthRequest,
                                             RolloutCameraImage, RolloutEgoTrajectory, RouteRequest,
                                             SessionRequestStatus, VersionId)  # fmt: skip

from alpamayo_ros.drive.planner import Planner
from alpamayo_ros.settings import DriveSettings
from alpamayo_ros.sim.loop import SessionLoop
from alpamayo_ros.sim.session import Drive, FieldError, Session

logger = logging.getLogger("alpamayo_egodriver")

#: AlpaSim's own convention for AvailableCamera.rig_to_camera (carla-driver-interface's revision 2).
CONTRACT_REVISION = "2"
VERSION = "alpamayo_ros-egodriver-0.1.0"

DriveObserver = Callable[[str, DriveRequest, Drive, float], None]  # session, request, answer, handler ms


class EgodriverService(EgodriverServiceServicer):
    """camera_map: AlpaSim logical camera id -> model camera index (the settings' cameras).

    on_drive: called after every answered drive() (the recorder), outside the session's lock.
    """

    def __init__(self, settings: DriveSettings, planner: Planner, camera_map: dict[str, int],
                 on_drive: DriveObserver | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.camera_map = dict(camera_map)
        self._planner = planner
        self._planner_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._on_drive = on_drive

    # -- sessions --

    def start_session(self, request: DriveSessionRequest, context: grpc.ServicerContext) -> SessionRequestStatus:
        def start() -> SessionRequestStatus:
            if not request.session_uuid:
                raise FieldError("session_uuid", "empty")
            declared = {camera.logical_id for camera in request.rollout_spec.vehicle.available_cameras}
            missing = sorted(set(self.camera_map) - declared)
            if missing:
                raise FieldError("rollout_spec.vehicle.available_cameras",
                                 f"the model's cameras {missing} are not declared (declared: {sorted(declared)})",
                                 grpc.StatusCode.FAILED_PRECONDITION)  # fmt: skip
            loop = SessionLoop(self.settings, self._planner, self._planner_lock, seed=int(request.random_seed))
            session = Session(request.session_uuid, loop, self.camera_map, self.settings.model_id)
            with self._sessions_lock:
                if request.session_uuid in self._sessions:
                    raise FieldError("session_uuid", f"session {request.session_uuid!r} already exists",
                                     grpc.StatusCode.ALREADY_EXISTS)  # fmt: skip
                self._sessions[request.session_uuid] = session
            logger.info("session %s started (seed %d)", request.session_uuid, request.random_seed)
            return SessionRequestStatus()

        return self._call(context, start)

    def close_session(self, request: DriveSessionCloseRequest, context: grpc.ServicerContext) -> Empty:
        def close() -> Empty:
            self._session(request.session_uuid)
            with self._sessions_lock:
                session = self._sessions.pop(request.session_uuid, None)
            if session is not None:
                counters = session.loop.loop.counters
                logger.info("session %s closed: %d plans started, rejected %s, %d observations superseded before "
                            "a drive", session.uuid, counters.started, dict(counters.rejected),
                            session.pending.superseded)  # fmt: skip
            return Empty()

        return self._call(context, close)

    # -- observations --

    def submit_image_observation(self, request: RolloutCameraImage, context: grpc.ServicerContext) -> Empty:
        return self._call(context, lambda: self._session(request.session_uuid).add_image(request) or Empty())

    def submit_egomotion_observation(self, request: RolloutEgoTrajectory, context: grpc.ServicerContext) -> Empty:
        return self._call(context, lambda: self._session(request.session_uuid).add_egomotion(request) or Empty())

    def submit_route(self, request: RouteRequest, context: grpc.ServicerContext) -> Empty:
        return self._call(context, lambda: self._session(request.session_uuid).add_route(request.route) or Empty())

    def submit_recording_ground_truth(self, request: GroundTruthRequest, context: grpc.ServicerContext) -> Empty:
        """Taken and ignored: a policy must not see the recording's future."""

        def ignore() -> Empty:
            self._session(request.session_uuid)
            return Empty()

        return self._call(context, ignore)

    # -- planning --

    def drive(self, request: DriveRequest, context: grpc.ServicerContext) -> DriveResponse:
        started = time.perf_counter()
        answered = self._call(context, lambda: self._session(request.session_uuid).drive(int(request.time_now_us)))
        if self._on_drive is not None:
            self._on_drive(request.session_uuid, request, answered, (time.perf_counter() - started) * 1e3)
        return answered.response

    def get_version(self, request: Empty, context: grpc.ServicerContext) -> VersionId:
        context.send_initial_metadata(((METADATA_KEY, CONTRACT_REVISION),))
        return VersionId(version_id=f"{VERSION} {self.settings.model_id} ({self.settings.backend})",
                         git_hash="unknown", grpc_api_version=ALPASIM_API_VERSION)  # fmt: skip

    # -- helpers --

    def _session(self, uuid: str) -> Session:
        with self._sessions_lock:
            session = self._sessions.get(uuid)
        if session is None:
            raise FieldError("session_uuid", f"no session {uuid!r} (start_session first, or it was closed)",
                             grpc.StatusCode.NOT_FOUND)  # fmt: skip
        return session

    def _call(self, context: grpc.ServicerContext, handler: Callable[[], object]):  # noqa: ANN202 - handler's type
        """Run a handler; a FieldError ends the call with its status, naming the field (a model fault is
        the tick's outcome, model_error, as in the node: an empty answer saying so)."""
        try:
            return handler()
        except FieldError as error:
            context.abort(error.code, str(error))
