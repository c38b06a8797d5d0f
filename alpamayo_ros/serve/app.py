"""The HTTP application: routes of the front doors over one PipelineWorker (the OpenAI-style
chat, the binary plan endpoint, the FlashDrive sidecar here; the NIM's routes in nim.py).

Security defaults live here too: an optional bearer key (every route but the health routes and
the schema), a body-size limit before anything is parsed, a deadline for the body to arrive,
and one JSON error shape for every refusal
({"error": {"message", "type", "param", "code"}}, OpenAI's), with the offending field in param.
Requests are parsed and validated in the thread pool (image decoding is not free), then queued
for the pipeline thread; nothing reaches the pipeline before it is valid as a whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..core.types import SamplingSettings
from . import chat, nim, sidecar, wire
from .frame_store import FrameStore
from .metrics import ServerMetrics
from .plan_request import parse_plan_request
from .requests import Limits, RequestError
from .worker import PipelineWorker, QueueFull

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # 16 resized frames are ~9 MB; 16 full-size PNGs ~70 MB
DEFAULT_BODY_TIMEOUT_S = 30.0  # 64 MB at ~20 Mbit/s; a body slower than this holds a connection for nothing
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerOptions:
    """model_name: the id of /v1/models, required in chat requests. queue_size: requests
    waiting for the pipeline before 503. default_settings: sampling of sidecar requests,
    which carry none. frame_store_frames / frame_store_bytes: bounds of the frames held for
    delta requests of the binary endpoint (all sessions together; 128 frames are 8 W16 windows
    of 16 resized full-HD frames, ~70 MB). allow_shm: requests may name shared-memory segments
    to read frames from (only for clients on this host; the CLI allows it for a loopback bind).
    body_timeout_s: the longest a request body may take to arrive once its headers are in;
    then 408 and the connection is closed."""

    model_name: str = "alpamayo-1.5"
    api_key: str | None = None
    queue_size: int = 4
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: Limits = field(default_factory=Limits)
    default_settings: SamplingSettings = field(default_factory=SamplingSettings)
    frame_store_frames: int = 128
    frame_store_bytes: int = 256 * 2**20
    allow_shm: bool = False
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


class Refused(Exception):
    """A request answered with an error; reason labels the rejection metric."""

    def __init__(self, status: int, reason: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.param = status, reason, message, param
        self.headers = headers or {}


def create_app(worker: PipelineWorker, options: ServerOptions) -> FastAPI:
    """The FastAPI app; it starts the worker (loading the pipeline) on startup, stops it on shutdown."""
    metrics = ServerMetrics(lambda: worker.depth)
    store = FrameStore(options.frame_store_frames, options.frame_store_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="alpamayo-serve", version="0.1.0", lifespan=lifespan,
                  description="Alpamayo 1.5 trajectories and answers over HTTP (one Pipeline).")
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes, metrics=metrics)
    app.add_middleware(BodyTimeout, timeout_s=options.body_timeout_s, metrics=metrics)

    def error(status: int, reason: str, message: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.rejections.labels(reason).inc()
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": reason}}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(Refused)
    async def refused(request: Request, refusal: Refused) -> Response:
        if request.url.path == "/predict":  # the sidecar client reads wire messages
            metrics.rejections.labels(refusal.reason).inc()
            return Response(sidecar.error_reply(refusal.message),
                            status_code=refusal.status, media_type=sidecar.CONTENT_TYPE, headers=refusal.headers)
        return error(refusal.status, refusal.reason, refusal.message, refusal.param, refusal.headers)

    @app.exception_handler(RequestError)
    async def invalid(request: Request, failure: RequestError) -> Response:
        return await refused(request, Refused(failure.status, failure.reason, f"{failure.field}: {failure.message}",
                                              failure.field))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, failure: RequestValidationError) -> Response:
        first = failure.errors()[0]
        # a JSON syntax error's loc is ("body", character offset): name the body
        param = "body" if first["type"] == "json_invalid" else ".".join(str(p) for p in first["loc"][1:]) or "body"
        return error(422, "invalid_request", f"{param}: {first['msg']}", param)

    @app.exception_handler(Exception)
    async def failed(request: Request, failure: Exception) -> Response:
        logger.exception("%s failed", request.url.path, exc_info=failure)
        return error(500, "internal_error", f"planning failed: {type(failure).__name__}: {failure}")

    @app.middleware("http")
    async def observe(request: Request, call_next: Callable) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        endpoint = request.scope.get("route").path if request.scope.get("route") else "unmatched"
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if response.status_code < 400:
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def authorized(request: Request) -> None:
        if options.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), options.api_key.encode()):
            raise Refused(401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)",
                          "Authorization", {"WWW-Authenticate": "Bearer"})

    def ensure_ready() -> None:
        if not worker.ready.is_set():
            state = "failed to load" if worker.failed else "still loading and warming up"
            raise Refused(503, "not_ready", f"the pipeline is {state}", headers={"Retry-After": str(RETRY_AFTER_S * 5)})

    async def run(job: Callable[[Any], Any]) -> Any:
        """Queue job(pipeline) and wait for it; 503 while loading or when the queue is full."""
        ensure_ready()
        try:
            future = worker.submit(job)
        except QueueFull as full:
            raise Refused(503, "queue_full", f"server busy: {full}", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            return await future
        except ValueError as failure:  # the pipeline refused an input the checks let through
            field_name = str(failure).split(":", 1)[0]
            raise Refused(400, "invalid_request", str(failure), field_name) from failure

    guarded = [Depends(authorized)]

    @app.get("/health", summary="200 once the pipeline is loaded and warmed up, else 503")
    async def health() -> JSONResponse:
        if worker.ready.is_set():
            return JSONResponse({"status": "ready", "model": options.model_name, "backend": worker.pipeline.backbone.name})
        if worker.failed is not None:
            return JSONResponse({"status": "failed", "error": str(worker.failed)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    def prometheus_text() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/metrics", dependencies=guarded, summary="Prometheus text format")
    async def prometheus() -> Response:
        return prometheus_text()

    def describe() -> dict:
        if not worker.ready.is_set():
            return {}
        pipeline = worker.pipeline
        dtype = str(getattr(pipeline, "dtype", "")).removeprefix("torch.")
        frames = pipeline.frames
        return {"backend": pipeline.backbone.name, "device": str(pipeline.device),
                "profile": f"{pipeline.backbone.name}-{dtype}" if dtype else pipeline.backbone.name,
                "frame_cache": {"frames": len(frames), "hits": frames.hits, "misses": frames.misses}}

    nim.register(app, run=run, ready=worker.ready.is_set, metrics_text=prometheus_text, count_plan=metrics.count_plan,
                 guarded=guarded,
                 model_name=options.model_name, limits=options.limits, describe=describe)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": options.model_name, "object": "model", "created": 0, "owned_by": "alpamayo_ros"}]}

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=chat.ChatCompletion,
              response_model_exclude_none=True)
    async def chat_completions(body: chat.ChatCompletionRequest) -> chat.ChatCompletion:
        nim.served_model(body.model, options.model_name)
        trajectory = body.output_modality == "trajectory" or (body.nvext is not None and body.nvext.egomotion is not None)
        if body.nvext is not None or not body.image_meta:  # the NIM's envelope: images in order, fields in nvext
            return await nim.chat_nim(body, trajectory, run=run, limits=options.limits, count_plan=metrics.count_plan)
        model = body.model or options.model_name

        def parse() -> tuple:
            settings = chat.sampling_settings(body, options.limits)
            inputs = chat.chat_driving_input(body, options.limits, require_history=trajectory)
            return inputs, settings, (None if trajectory else chat.question(body)), chat.answer_length(body, options.limits)

        inputs, settings, question, length = await run_in_threadpool(parse)
        if trajectory:
            def plan_job(pipeline: Any) -> chat.ChatCompletion:
                plan = pipeline.plan(inputs, settings)
                metrics.count_plan(plan)
                return chat.trajectory_completion(plan, model, chat.prompt_tokens(pipeline, inputs))
            return await run(plan_job)

        def text_job(pipeline: Any) -> chat.ChatCompletion:
            replies = pipeline.generate_text(inputs, question, settings, max_new_tokens=length)
            return chat.text_completion(replies, length, model, chat.prompt_tokens(pipeline, inputs, question))
        return await run(text_job)

    @app.get("/v1/plan/info", dependencies=guarded,
             summary="What a binary-endpoint client needs: the frame geometry the pipeline resizes to")
    async def plan_info() -> dict:
        ensure_ready()
        return {"model": options.model_name, "backend": worker.pipeline.backbone.name,
                "vision": dataclasses.asdict(worker.pipeline.config.vision), "frame_store": store.stats()}

    @app.post("/v1/plan", dependencies=guarded, response_class=Response,
              summary="Binary planning (msgpack, see alpamayo_ros/serve/wire.py): frames already resized, "
                      "all inline or as a delta (new frames inline, or at capture size in shared memory); "
                      "409 frames_missing when a referenced frame is not held")
    async def plan_binary(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != wire.CONTENT_TYPE:
            raise Refused(415, "invalid_request", f"content-type must be {wire.CONTENT_TYPE}", "content-type")
        ensure_ready()  # a delta's frame size is checked against the pipeline's geometry
        body = await request.body()
        started = time.perf_counter()
        parse_ms = [0.0]

        def parse() -> tuple:
            begun = time.perf_counter()
            parsed = parse_plan_request(body, options.limits, store, worker.pipeline.frames, options.allow_shm)
            parse_ms[0] = (time.perf_counter() - begun) * 1e3
            return parsed

        inputs, settings, capture_size = await run_in_threadpool(parse)
        queued = time.perf_counter()

        def job(pipeline: Any) -> bytes:
            dequeued = time.perf_counter()
            resize_ms, keyed = 0.0, inputs
            if capture_size is not None:  # on the pipeline's thread and device, as in-process planning resizes
                keyed = capture_size.resize_into(pipeline.frames, store, inputs)
                resize_ms = (time.perf_counter() - dequeued) * 1e3
            plan = pipeline.plan(keyed, settings)
            metrics.count_plan(plan)
            # serve.shm_read and serve.parse_wait (the hop to and from the parsing thread) are parts of serve.parse
            parsed_ms = (queued - started) * 1e3
            plan.timings_ms.update({"serve.parse": parsed_ms, "serve.queue": (dequeued - queued) * 1e3,
                                    "serve.resize": resize_ms, "serve.parse_wait": parsed_ms - parse_ms[0],
                                    "serve.shm_read": capture_size.read_ms if capture_size is not None else 0.0})
            return wire.encode_reply(plan)

        return Response(await run(job), media_type=wire.CONTENT_TYPE)

    @app.post("/predict", dependencies=guarded, response_class=Response,
              summary="FlashDrive sidecar protocol (Autoware's Alpamayo node)")
    async def sidecar_predict(request: Request) -> Response:
        start = time.perf_counter()
        body = await request.body()
        now_ns = time.time_ns()

        def parse() -> Any:
            meta, arrays = sidecar.decode_predict(body, options.allow_shm)
            return sidecar.predict_input(meta, arrays, options.limits, now_ns)

        inputs = await run_in_threadpool(parse)
        plan = await run(lambda pipeline: pipeline.plan(inputs, options.default_settings))
        metrics.count_plan(plan)
        return Response(sidecar.predict_reply(plan, time.perf_counter() - start), media_type=sidecar.CONTENT_TYPE)

    @app.post("/reset", dependencies=guarded, response_class=Response,
              summary="FlashDrive sidecar protocol: nothing streams across requests here, so a no-op")
    async def sidecar_reset() -> Response:
        return Response(sidecar.encode({"status": "ok"}, {}), media_type=sidecar.CONTENT_TYPE)

    return app


class BodyTimeout:
    """ASGI middleware: a request body must arrive within timeout_s of its headers. A client
    that stops sending mid-body gets 408 (or, if an answer has begun, a dropped connection)
    instead of holding its connection open for ever. Only waits for body bytes are bounded:
    once the body is complete, a route may wait on the connection (for a disconnect) as long
    as it runs."""

    def __init__(self, app: Any, timeout_s: float, metrics: ServerMetrics) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.app, self.timeout_s, self.metrics = app, timeout_s, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        state = {"body_done": False, "started": False, "timed_out": False}

        async def bounded_receive() -> dict:
            if state["body_done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                state["timed_out"] = True
                raise BodyTimedOut(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def tracked_send(message: dict) -> None:
            if state["timed_out"]:
                return  # the app's answer to a body it never got (FastAPI makes it a 400); ours follows
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception:
            if not state["timed_out"]:
                raise
        if not state["timed_out"] or state["started"]:  # too late for a status: the server drops the connection
            return
        self.metrics.rejections.labels("body_timeout").inc()
        message = f"request body not received within {self.timeout_s:g} s"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": "body", "code": "body_timeout"}}
        await JSONResponse(body, status_code=408, headers={"Connection": "close"})(scope, receive, send)


class BodyTimedOut(Exception):
    """The request body did not arrive in time (BodyTimeout answers it)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not received within {timeout_s:g} s")


class BodyLimit:
    """ASGI middleware: refuse bodies over max_bytes with 413 before any route reads them
    (by Content-Length, or by counting a chunked body while buffering it)."""

    def __init__(self, app: Any, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        self.metrics.rejections.labels("body_too_large").inc()
        message = f"request body over the limit of {self.max_bytes} bytes"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": "body", "code": "body_too_large"}}
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
