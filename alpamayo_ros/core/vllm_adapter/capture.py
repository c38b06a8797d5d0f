"""The K/V capture: a KV connector that keeps each finished request's blocks for the expert.

How the K/V reaches the caller: a KV connector (vLLM's experimental ``KVConnectorBase_V1``)
whose scheduler-side ``request_finished`` hook fires once per request, after the last forward
and before the request's blocks are freed. For a request the backbone asked for, the hook
records which blocks hold it (HeldKV) and answers "free later", vLLM's own contract for a
connector still sending a request's K/V: the blocks stay allocated, so nothing overwrites
them, until the worker-side ``get_finished`` reports the request as finished sending, which
it does once the caller released it (CaptureSink.release, after the expert read the blocks
in place through the cache tensors the worker side registered). Both instances must live in
the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker), which is also how
the cache tensors reach the backbone without a transport. No per-layer hook runs inside the
forward, so full CUDA graphs stay on. (Tensor parallel, tp.py, overrides CaptureSink.take to
copy the shards inside the workers instead, and holds nothing.)
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .kv_layout import CacheLayout, block_views, detect_layout, read_blocks

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "CaptureKVConnector"
#: kv_connector_extra_config key naming the sink a connector instance joins.
SINK_KEY = "alpamayo_capture_sink"


@dataclass
class CapturedKV:
    """K/V of one finished request, copied out: one (T, H, D) tensor per decoder layer, T = tokens fed."""

    token_ids: list[int]  # every token of the request the engine saw (prompt + sampled)
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class HeldKV:
    """A finished request whose K/V stay in the paged cache: its blocks, held until released."""

    request_id: str
    token_ids: list[int]  # every token of the request the engine saw (prompt + sampled)
    block_ids: list[int]  # the scheduler's blocks, in position order
    num_tokens: int  # positions [0, num_tokens) hold its K/V (the tokens fed)


@dataclass
class CaptureSink:
    """Meeting point of the two connector instances and the backbone, all in one process.

    The worker side fills the cache tensors and layouts; the scheduler side records finished
    requests that the backbone asked for (``wanted``) in ``captured`` and holds their blocks
    (``held``) until the backbone releases them; the worker side then reports them freeable
    (``releasing``) and the scheduler side sees them freed (``freeing`` empties).
    """

    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    caches: list[torch.Tensor] = field(default_factory=list)  # one per decoder layer, in order
    layouts: list[CacheLayout] = field(default_factory=list)
    scheduler_block_size: int = 0
    wanted: set[str] = field(default_factory=set)
    captured: dict[str, CapturedKV | HeldKV] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # finished requests whose blocks are held
    releasing: set[str] = field(default_factory=set)  # released, not yet reported by the worker side
    freeing: set[str] = field(default_factory=set)  # released, not yet freed by the scheduler
    # NOTE: the worker side may report from the engine's execution thread (async scheduling)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transfer_config(self) -> dict[str, Any]:
        """The kv_transfer_config that installs the capture connector for this sink."""
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_both",
            "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {SINK_KEY: self.key},
        }

    def take(self, request_id: str, token_ids: list[int], block_ids: list[int], num_tokens: int) -> CapturedKV | HeldKV:
        """What the backbone gets of a finished request: here a record of its blocks, which the
        connector then holds (a HeldKV); a copy (CapturedKV) leaves them to be freed now."""
        return HeldKV(request_id, token_ids, block_ids, num_tokens)

    def release(self, request_ids: list[str]) -> None:
        """The backbone is done with these requests' blocks: the next engine step frees them.

        Requests that never finished are no longer wanted (if they finish later, their blocks
        are freed at once). Safe from any thread and for ids released before.
        """
        with self.lock:
            for request_id in request_ids:
                self.wanted.discard(request_id)
                if request_id in self.held:
                    self.held.discard(request_id)
                    self.releasing.add(request_id)
                    self.freeing.add(request_id)

    def read(self, block_ids: list[int], num_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K/V of the positions [0, num_tokens) held by these scheduler blocks, copied."""
        if not self.caches:
            raise RuntimeError("KV capture: the worker never registered its caches")
        kernel_ids: dict[int, torch.Tensor] = {}  # built once per kernel block size
        keys, values = [], []
        for cache, layout in zip(self.caches, self.layouts):
            if layout.block_size not in kernel_ids:
                ids = self.kernel_block_ids(block_ids, layout.block_size, num_tokens)
                kernel_ids[layout.block_size] = ids.to(cache.device)
            k, v = read_blocks(cache, layout, kernel_ids[layout.block_size], num_tokens)
            keys.append(k)
            values.append(v)
        return keys, values

    def block_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Per layer, K and V as (kernel blocks, block_size, H, D) views of the cache (no copy),
        and that block size (one for all layers)."""
        if not self.caches:
            raise RuntimeError("KV capture: the worker never registered its caches")
        sizes = {layout.block_size for layout in self.layouts}
        if len(sizes) != 1:
            raise RuntimeError(f"KV capture: layers use kernel block sizes {sorted(sizes)}; the expert reads one")
        views = [block_views(cache, layout) for cache, layout in zip(self.caches, self.layouts)]
        return [k for k, _ in views], [v for _, v in views], sizes.pop()

    def kernel_block_ids(self, block_ids: list[int], kernel_block_size: int, num_tokens: int) -> torch.Tensor:
        """The kernel blocks holding the first num_tokens positions of these scheduler blocks.

        The attention kernel may use smaller blocks than the scheduler: scheduler block b is
        then kernel blocks b*per .. b*per+per-1 (vLLM's block table does the same mapping).
        """
        if self.scheduler_block_size % kernel_block_size:
            raise ValueError(
                f"kernel block size {kernel_block_size} does not divide the scheduler's {self.scheduler_block_size}"
            )
        per = self.scheduler_block_size // kernel_block_size
        # numpy, not torch: a plan builds one list per row on the host, before the expert starts
        ids = (np.asarray(block_ids, dtype=np.int64)[:, None] * per + np.arange(per)).reshape(-1)
        needed = -(-num_tokens // kernel_block_size)
        if ids.size < needed:
            raise RuntimeError(f"KV capture: {len(block_ids)} blocks hold fewer than {num_tokens} tokens")
        return torch.from_numpy(ids[:needed])


_SINKS: dict[str, CaptureSink] = {}


def open_sink(sink: CaptureSink | None = None) -> CaptureSink:
    """A new sink (or this one), findable by the connector instances the engine will construct."""
    sink = CaptureSink() if sink is None else sink
    _SINKS[sink.key] = sink
    return sink


def find_sink(key: str) -> CaptureSink:
    """The sink open_sink registered under key in this process (tp.py's worker calls)."""
    return _SINKS[key]


def close_sink(sink: CaptureSink) -> None:
    _SINKS.pop(sink.key, None)


class _NoMetadata(KVConnectorMetadata):
    """The capture needs nothing passed from scheduler to worker per step."""


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class CaptureKVConnector(KVConnectorBase_V1):
    """Holds each finished request's blocks for the backbone (see module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        key = self._kv_transfer_config.kv_connector_extra_config.get(SINK_KEY)
        if key not in _SINKS:
            raise RuntimeError(
                "KV capture sink not found: the vLLM engine must run in the caller's process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size=1 executor in-process)"
            )
        self._sink = _SINKS[key]
        self._sink.scheduler_block_size = vllm_config.cache_config.block_size

    @property
    def requires_kv_delivery(self) -> bool:  # vLLM >= 0.27: nothing is handed off asynchronously
        return False

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model_config = self._vllm_config.model_config
        text = model_config.hf_text_config
        num_kv_heads = text.num_key_value_heads // self._vllm_config.parallel_config.tensor_parallel_size
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        layers = self._vllm_config.compilation_config.static_forward_context
        indexed = []
        for name, cache in kv_caches.items():
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"kv cache layer name {name!r}: no '.layers.N.' index")
            attn = layers[name]
            backend = attn.attn_backend.get_name()
            isa = getattr(getattr(attn, "impl", None), "isa", None)
            layout = detect_layout(backend, isa, cache, num_kv_heads, head_dim, model_config.dtype)
            indexed.append((int(match.group(1)), cache, layout))
        indexed.sort(key=lambda item: item[0])
        if [i for i, _, _ in indexed] != list(range(len(indexed))):
            raise ValueError(f"kv cache layers: indices {[i for i, _, _ in indexed]} are not 0..N-1")
        self._sink.caches = [c for _, c, _ in indexed]
        self._sink.layouts = [lay for _, _, lay in indexed]
        logger.info("KV capture: %d layers, layout %s", len(indexed), indexed[0][2] if indexed else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the released requests as finished sending: the scheduler frees their blocks."""
        with self._sink.lock:
            done, self._sink.releasing = self._sink.releasing, set()
        return done or None, None

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        """The scheduler frees the blocks of the requests reported here, right after this call."""
        sent = connector_output.finished_sending or ()
        if sent:
            with self._sink.lock:
                self._sink.freeing.difference_update(sent)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Record a wanted request's blocks; True holds them until it is released."""
        req_id = request.request_id
        with self._sink.lock:
            if req_id not in self._sink.wanted:
                return False, None
            self._sink.wanted.discard(req_id)
        token_ids = list(request.all_token_ids)
        num_fed = len(token_ids) - 1  # the last sampled token was never fed back
        if request.num_computed_tokens < num_fed:
            computed = request.num_computed_tokens
            raise RuntimeError(f"KV capture: request {req_id} computed {computed} < {num_fed} tokens")
        capture = self._sink.take(req_id, token_ids, list(block_ids), num_fed)
        hold = isinstance(capture, HeldKV)
        with self._sink.lock:
            self._sink.captured[req_id] = capture
            if hold:
                self._sink.held.add(req_id)
        return hold, None
