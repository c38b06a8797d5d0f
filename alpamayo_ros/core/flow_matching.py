"""Flow-matching sampler: Euler-integrate the expert's velocity field from noise to an action.

Upstream's convention: t = 0 is noise, t = 1 is data, and the model predicts the velocity
x_data - noise. The noise comes from an explicit torch.Generator (never the global RNG), so a
seed fully determines a plan and parallel pipelines cannot disturb each other's streams.

`sample` integrates any velocity function (the reference). `ExpertSampler` runs the same
integration over the action expert the fast way: prefix caches copied once into persistent,
length-bucketed paged ExpertStates, and on CUDA the whole loop replayed as one CUDA graph.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, LayerStep, layer_step
from alpamayo_ros.core.expert_state import BlockTableState, ExpertState
from alpamayo_ros.core.types import NUM_WAYPOINTS, PlanCancelled

logger = logging.getLogger(__name__)

#: velocity_fn(x (N, 64, 2), t (N,)) -> velocity (N, 64, 2)
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ACTION_SHAPE = (NUM_WAYPOINTS, 2)  # (waypoints, [normalised accel, normalised curvature])


def initial_noise(
    batch: int,
    *,
    noise_temperature: float = 1.0,
    generator: torch.Generator | None = None,
    init_noise: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x0 = noise * noise_temperature, (batch, 64, 2) on `device`.

    noise is randn from `generator` or, if given, init_noise (a standard-normal draw).
    """
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    if not noise_temperature >= 0:
        raise ValueError(f"noise_temperature: must be >= 0, got {noise_temperature}")
    shape = (batch, *ACTION_SHAPE)
    if init_noise is None:
        if generator is None:
            raise ValueError("generator: required when init_noise is not given")
        # Drawn on the generator's device, so a CPU generator gives the same noise for CPU
        # and GPU runs.
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    elif tuple(init_noise.shape) != shape:
        raise ValueError(f"init_noise: expected {shape}, got {tuple(init_noise.shape)}")
    else:
        noise = init_noise
    return noise.to(device=device, dtype=dtype) * noise_temperature


def integrate(
    velocity_fn: VelocityFn,
    x0: torch.Tensor,
    *,
    steps: int = 10,
    uncond_velocity_fn: VelocityFn | None = None,
    guidance_weight: float = 1.0,
) -> torch.Tensor:
    """Euler-integrate x0 (N, 64, 2) from t = 0 to 1 in `steps` steps; no host syncs.

    With uncond_velocity_fn, the velocity is classifier-free guided:
    v = (1 - w) * v_uncond + w * v_cond, w = guidance_weight (w = 1: conditional only).
    """
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    if uncond_velocity_fn is None and guidance_weight != 1.0:
        raise ValueError(
            f"guidance_weight: {guidance_weight} needs uncond_velocity_fn (only 1.0 works without)"
        )
    x = x0
    times = torch.linspace(0.0, 1.0, steps + 1, device=x.device, dtype=x.dtype)
    for i in range(steps):
        t = times[i].expand(x.shape[0])
        # (1, 1, 1), not 0-dim: a 0-dim fp32 step times a bf16 velocity would stay bf16, while
        # upstream's (batch, 1, 1) step promotes the update to fp32.
        step = (times[i + 1] - times[i]).view(1, 1, 1)
        velocity = velocity_fn(x, t)
        if uncond_velocity_fn is not None:
            velocity = guide(velocity, uncond_velocity_fn(x, t), guidance_weight)
        x = x + step * velocity
    return x


def guide(velocity: torch.Tensor, unguided: torch.Tensor, weight: float) -> torch.Tensor:
    """Classifier-free guidance (Guided Flows eq. 6)."""
    return (1 - weight) * unguided + weight * velocity


def sample(
    velocity_fn: VelocityFn,
    *,
    batch: int,
    steps: int = 10,
    noise_temperature: float = 1.0,
    generator: torch.Generator | None = None,
    init_noise: torch.Tensor | None = None,
    uncond_velocity_fn: VelocityFn | None = None,
    guidance_weight: float = 1.0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw `batch` normalised actions (batch, 64, 2) by `steps` Euler steps.

    See initial_noise (x0) and integrate (the loop, optionally guided). The loop has no host
    syncs, so a caller can capture it in one CUDA graph.
    """
    x0 = initial_noise(
        batch, noise_temperature=noise_temperature, generator=generator, init_noise=init_noise,
        device=device, dtype=dtype,
    )
    return integrate(
        velocity_fn, x0, steps=steps, uncond_velocity_fn=uncond_velocity_fn,
        guidance_weight=guidance_weight,
    )


@dataclass
class _Runner:
    """Static buffers (and on CUDA the captured graph) of one (capacity, rows, ...) shape."""

    state: ExpertState | BlockTableState  # conditional rows first, then route-free rows when guided
    x0: torch.Tensor  # (N, 64, 2) fp32, copied in before each run
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # what the graph writes
    state_bytes: int = 0  # GPU memory its state allocated
    graph_bytes: int = 0  # GPU memory its capture added to the graphs' shared pool


class ExpertSampler:
    """`sample` over the action expert, fast: one persistent state and CUDA graph per shape.

    A plan's own columns (prefix past any shared prompt, + 64 action tokens) are rounded up
    to a bucket, capacity = k * bucket, and a shared prompt's length too: the attention reads
    each row's used length only (expert_state.py), so one captured graph serves every plan of
    that bucket and row count, with nothing masked. A guided plan runs conditional and
    route-free rows as one batch, so each step reads the weights once. Samples of one prompt
    (a cache with a shared part) keep the prompt once; their own columns are rounded up to
    min(bucket, 64). A paged cache (K/V an engine holds, PrefixCache.paged) is read in place:
    its state holds block tables of the longest row's bucket in blocks. Graphs are captured
    lazily on first use of a shape and kept (about 1 s); on CPU (or with cuda_graphs=False)
    the same states run eagerly.

    compile_layers: torch.compile the layer step (fuses the norms, RoPE and K/V writes; 30%
    faster on an H200). Compiled per shape, so a new shape's first call takes seconds; past
    dynamo's recompile limit (8 shapes) further shapes run the layer uncompiled.

    The max_shapes most recently used shapes keep their state (~0.5 GB per row at full size,
    T ~3100) and graph; older ones are dropped and rebuilt on demand. Valid while
    the expert's parameters stay where they are: a graph holds their addresses.
    """

    #: set by the Pipeline: eager sampling stops (PlanCancelled) between flow steps once it is set
    stop: threading.Event | None = None

    def __init__(
        self,
        expert: ActionExpertModel,
        *,
        bucket: int = 256,
        cuda_graphs: bool = True,
        compile_layers: bool = False,
        max_shapes: int = 4,
    ) -> None:
        if bucket < 1:
            raise ValueError(f"bucket: must be >= 1, got {bucket}")
        if max_shapes < 1:
            raise ValueError(f"max_shapes: must be >= 1, got {max_shapes}")
        self.max_shapes = max_shapes
        self.expert = expert
        self.bucket = bucket
        self.device = expert.expert.norm.weight.device
        self.uses_cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # One compile serves all layers: they differ only in weights, which are inputs.
        self._step: LayerStep = (
            torch.compile(layer_step, fullgraph=True, dynamic=False) if compile_layers else layer_step
        )
        # Least recently used shape first; bounded so a long-running node with varying prompt
        # lengths keeps at most max_shapes states (and graphs) alive.
        self._runners: OrderedDict[tuple[int, int, int, float | None, int], _Runner] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.uses_cuda_graphs else None

    def _round(self, columns: int, bucket: int) -> int:
        return -(-columns // bucket) * bucket

    def capacity_for(self, length: int) -> int:
        """Key columns per row of a copying state for a prefix of `length` tokens."""
        return self._round(length + self.expert.config.n_waypoints, self.bucket)

    @torch.inference_mode()
    def sample(
        self,
        cache: PrefixCache,
        *,
        steps: int = 10,
        noise_temperature: float = 1.0,
        generator: torch.Generator | None = None,
        init_noise: torch.Tensor | None = None,
        uncond_cache: PrefixCache | None = None,
        guidance_weight: float = 1.0,
    ) -> torch.Tensor:
        """Same result as `sample(lambda x, t: expert.velocity(x, t, cache), ...)`: (N, 64, 2).

        uncond_cache: the route-free prefix, same rows as cache (any length), for guidance.
        """
        if steps < 1:
            raise ValueError(f"steps: must be >= 1, got {steps}")
        if uncond_cache is None and guidance_weight != 1.0:
            raise ValueError(
                f"guidance_weight: {guidance_weight} needs uncond_cache (only 1.0 works without)"
            )
        paged = cache.paged is not None
        if uncond_cache is not None and (uncond_cache.paged is not None) != paged:
            raise ValueError("uncond_cache: must be paged exactly when cache is (one engine makes both)")
        rows = cache.rows
        caches = [cache] if uncond_cache is None else [cache, uncond_cache]
        if any(c.rows != rows for c in caches):
            raise ValueError(f"uncond_cache: {uncond_cache.rows} rows, cache has {rows}")
        x0 = initial_noise(
            rows, noise_temperature=noise_temperature, generator=generator,
            init_noise=init_noise, device=self.device,
        )
        weight = None if uncond_cache is None else guidance_weight
        if paged:
            # blocks per row, for the longest row rounded to the bucket; one state per engine cache
            block_size = cache.paged.block_size
            capacity = -(-self._round(max(c.length for c in caches), self.bucket) // block_size)
        else:
            capacity = self.capacity_for(max(c.length for c in caches))
        storage = cache.paged.key_blocks[0].data_ptr() if paged else 0  # a state reads one engine's blocks
        key = (capacity, rows, steps, weight, storage)
        runner = self._runners.get(key)
        fresh = runner is None
        if fresh:
            before = self._allocated()
            if paged:
                state = self.expert.new_paged_state(rows * len(caches), capacity, cache)
            else:
                state = self.expert.new_state(rows * len(caches), capacity)
            runner = _Runner(state=state, x0=torch.zeros_like(x0), state_bytes=self._allocated() - before)
            self._runners[key] = runner
            if len(self._runners) > self.max_shapes:
                self._runners.popitem(last=False)
            logger.info(f"expert sampler: new state for {key} (capacity, rows, steps, cfg, storage)")
        else:
            self._runners.move_to_end(key)
        self.expert.load_state(runner.state, caches)
        runner.x0.copy_(x0)
        if not self.uses_cuda_graphs:
            return self._integrate(runner.state, runner.x0, steps, weight)
        if fresh:
            self._capture(runner, steps, weight)
        runner.graph.replay()
        return runner.output.clone()

    def _integrate(
        self, state: ExpertState | BlockTableState, x0: torch.Tensor, steps: int, weight: float | None
    ) -> torch.Tensor:
        """Euler loop over a loaded state; guided rows ride along in the same batch."""

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if self.stop is not None and self.stop.is_set():  # a host check, never captured
                raise PlanCancelled("flow matching cancelled: the pipeline is stopping")
            if weight is None:
                return self.expert.velocity_prepared(x, t, state, step=self._step)
            both = self.expert.velocity_prepared(torch.cat([x, x]), torch.cat([t, t]), state, step=self._step)
            conditional, unguided = both.chunk(2)
            return guide(conditional, unguided, weight)

        return integrate(velocity, x0, steps=steps)

    def _capture(self, runner: _Runner, steps: int, weight: float | None) -> None:
        # Warm up on a side stream first (cuBLAS/flash workspaces, torch.compile), as CUDA
        # graph capture requires; all runners share one memory pool, they never overlap.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._integrate(runner.state, runner.x0, steps, weight)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # capturing empties the allocator's cache first, so measure from an emptied cache too
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.cuda.graph(graph, pool=self._pool):
            runner.output = self._integrate(runner.state, runner.x0, steps, weight)
        runner.graph = graph
        runner.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info(
            f"expert sampler: state {runner.state_bytes / 2**30:.3f} GiB, graph pool +{runner.graph_bytes / 2**30:.3f} GiB"
        )

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def memory_gib(self) -> dict[str, float]:
        """GPU memory the kept shapes hold: their static states, and what capturing their
        graphs added to the pool they share (GiB; zeros on the CPU)."""
        runners = self._runners.values()
        return {
            "shapes": len(runners),
            "states_gib": sum(r.state_bytes for r in runners) / 2**30,
            "graphs_gib": sum(r.graph_bytes for r in runners) / 2**30,
        }
