"""The binary plan endpoint's format: msgpack maps with typed arrays, shared by server and client.

msgpack (through msgspec, which vLLM already brings) decodes into plain data only (no pickle, no
code), and every array travels as {dtype, shape, data} so the receiver checks the dtype, the
shape and the byte count before it builds a view. Decoding names the field at fault.

A plan request carries its window's frames one of two ways: all of them inline (`images`), or as
a delta within a session (`session`, `frame_size`, `sent_slots`, and `sent` or `shm`): only the
frames the server does not hold yet travel, and every other slot of the (cameras, frames) window
refers to the frame this session sent before for that camera and stamp, at that size (see
frame_store). The new frames travel inline, resized to frame_size (`sent`), or, from a client on
the server's host, at capture size in the client's shared memory (`shm`, see shm.py): the server
then resizes them itself, on its device.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..core.types import DrivingInput, Plan, SamplingSettings

CONTENT_TYPE = "application/msgpack"


class WireError(ValueError):
    """A malformed binary request or reply; field names the part at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Array(msgspec.Struct, forbid_unknown_fields=True):
    """One C-ordered array: numpy dtype name, shape, raw bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class ShmFrames(msgspec.Struct, forbid_unknown_fields=True):
    """Frames in a client's shared-memory segment: C-ordered at offset bytes into segment name."""

    name: str
    offset: int
    dtype: str  # numpy dtype name; frames are uint8
    shape: list[int]  # (n, H, W, 3), capture size


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    """SamplingSettings on the wire; omitted fields take SamplingSettings' defaults."""

    num_samples: int = SamplingSettings.num_samples
    temperature: float = SamplingSettings.temperature
    top_p: float = SamplingSettings.top_p
    max_reasoning_tokens: int = SamplingSettings.max_reasoning_tokens
    min_reasoning_tokens: int = SamplingSettings.min_reasoning_tokens
    flow_steps: int = SamplingSettings.flow_steps
    noise_temperature: float = SamplingSettings.noise_temperature
    cfg_weight: float | None = SamplingSettings.cfg_weight
    seed: int = SamplingSettings.seed


class PlanRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A DrivingInput (frames resized for the vision tower; a delta's new frames in shm are at
    capture size) and its settings."""

    images: Array | None = None  # uint8 (cameras, frames, h, w, 3): every frame inline
    session: str | None = None  # delta requests: the client's frame-store session
    frame_size: list[int] | None = None  # delta requests: (h, w) of every frame of the window
    sent: Array | None = None  # delta requests: uint8 (n, h, w, 3), the frames the server lacks
    shm: ShmFrames | None = None  # delta requests, instead of sent: those frames at capture size
    sent_slots: list[int] = msgspec.field(default_factory=list)  # their window slots, camera-major
    camera_indices: list[int]
    frame_stamps_ns: Array  # int64 (cameras, frames)
    t0_ns: int
    ego_history_xyz: Array  # float32 (16, 3)
    ego_history_rot: Array  # float32 (16, 3, 3)
    settings: Settings = msgspec.field(default_factory=Settings)
    route_text: str | None = None


class PlanReply(msgspec.Struct, forbid_unknown_fields=True):
    """A Plan's arrays and text."""

    xyz: Array  # float32 (samples, 64, 3)
    rot: Array  # float32 (samples, 64, 3, 3)
    coc: list[str]
    reasoning_closed: list[bool]  # per sample: False = the reasoning was cut at the token budget
    generated_ids: list[list[int]]
    t0_ns: int
    backend: str
    timings_ms: dict[str, float]
    drafted_tokens: int = 0  # speculative reasoning, all samples: drafts verified (0: speculation off)
    accepted_tokens: int = 0  # ... and accepted


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(PlanRequest)
_REPLY_DECODER = msgspec.msgpack.Decoder(PlanReply)


def pack_array(array: np.ndarray) -> Array:
    """array for encoding; its bytes are a view (the encoder copies them once, into the message)."""
    contiguous = np.ascontiguousarray(array)
    return Array(dtype=contiguous.dtype.str, shape=list(contiguous.shape), data=memoryview(contiguous).cast("B"))


def unpack_array(field: str, array: Array, dtype: np.dtype | type, ndim: int) -> np.ndarray:
    """The array as numpy (a read-only view of the message bytes) after checking what it claims."""
    try:
        claimed = np.dtype(array.dtype)
    except TypeError as error:
        raise WireError(field, f"unknown dtype {array.dtype!r}") from error
    if claimed != np.dtype(dtype):
        raise WireError(field, f"expected dtype {np.dtype(dtype).name}, got {claimed.name}")
    if len(array.shape) != ndim or any(side < 0 for side in array.shape):
        raise WireError(field, f"expected {ndim} non-negative dimensions, got shape {array.shape}")
    expected = int(np.prod(array.shape, dtype=np.int64)) * claimed.itemsize
    if expected != len(array.data):
        raise WireError(field, f"shape {array.shape} needs {expected} bytes, got {len(array.data)}")
    return np.frombuffer(array.data, dtype=claimed).reshape(array.shape)


def encode_request(
    inputs: DrivingInput,
    settings: SamplingSettings,
    *,
    session: str | None = None,
    sent_slots: list[int] | None = None,
    sent: np.ndarray | None = None,
    shm: tuple[ShmFrames, tuple[int, int]] | None = None,
) -> bytes:
    """The request for inputs: every frame inline, or (with a session) a delta that carries the
    frames of sent_slots (camera-major window slots) and refers to all others. sent: those frames,
    uint8 (n, h, w, 3) resized (default: taken from inputs, resized then); inputs' frames are then
    not read. shm: (where the sent frames are, the frame size the server resizes them to)."""
    slots = list(sent_slots or [])
    if session is None:
        frames: dict = {"images": pack_array(inputs.images)}
    elif shm is not None:
        where, frame_size = shm
        frames = {"session": session, "frame_size": list(frame_size), "shm": where, "sent_slots": slots}
    else:
        if sent is None:
            sent = inputs.images.reshape(-1, *inputs.images.shape[2:])[slots]
        frames = {"session": session, "frame_size": list(sent.shape[1:3]), "sent": pack_array(sent),
                  "sent_slots": slots}
    request = PlanRequest(
        **frames,
        camera_indices=list(inputs.camera_indices),
        frame_stamps_ns=pack_array(inputs.frame_stamps_ns.astype(np.int64, copy=False)),
        t0_ns=int(inputs.t0_ns),
        ego_history_xyz=pack_array(inputs.ego_history_xyz.astype(np.float32, copy=False)),
        ego_history_rot=pack_array(inputs.ego_history_rot.astype(np.float32, copy=False)),
        settings=Settings(**{name: getattr(settings, name) for name in Settings.__struct_fields__}),
        route_text=inputs.route_text,
    )
    return _ENCODER.encode(request)


def decode_request(body: bytes) -> PlanRequest:
    """Parse (not yet validate) a binary plan request; structural errors name the field."""
    try:
        return _REQUEST_DECODER.decode(body)
    except msgspec.ValidationError as error:  # "Expected `int`, got `str` - at `$.settings.seed`"
        raise WireError(_error_path(str(error)), str(error)) from error
    except msgspec.DecodeError as error:
        raise WireError("body", f"not a msgpack plan request ({error})") from error


def encode_reply(plan: Plan) -> bytes:
    reply = PlanReply(
        xyz=pack_array(plan.xyz.astype(np.float32, copy=False)),
        rot=pack_array(plan.rot.astype(np.float32, copy=False)),
        coc=list(plan.coc),
        reasoning_closed=list(plan.reasoning_closed),
        generated_ids=[list(row) for row in plan.generated_ids],
        t0_ns=int(plan.t0_ns),
        backend=plan.backend,
        timings_ms=dict(plan.timings_ms),
        drafted_tokens=plan.drafted_tokens,
        accepted_tokens=plan.accepted_tokens,
    )
    return _ENCODER.encode(reply)


def decode_reply(body: bytes) -> Plan:
    try:
        reply = _REPLY_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError("reply", str(error)) from error
    return Plan(
        xyz=unpack_array("reply.xyz", reply.xyz, np.float32, 3).copy(),
        rot=unpack_array("reply.rot", reply.rot, np.float32, 4).copy(),
        coc=reply.coc,
        reasoning_closed=reply.reasoning_closed,
        generated_ids=reply.generated_ids,
        t0_ns=reply.t0_ns,
        backend=reply.backend,
        timings_ms=reply.timings_ms,
        drafted_tokens=reply.drafted_tokens,
        accepted_tokens=reply.accepted_tokens,
    )


def _error_path(message: str) -> str:
    """`$.settings.seed` in a msgspec error -> "settings.seed"; "body" when there is none."""
    marker = "at `$"
    if marker not in message:
        return "body"
    path = message.split(marker, 1)[1].split("`", 1)[0]
    return path.lstrip(".") or "body"
