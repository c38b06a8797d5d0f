"""One planning request end to end: DrivingInput -> Plan.

preprocess frames -> render the prompt (history tokens in place) -> backbone rollout
(reasoning + K/V) -> [route-free prefill for nav classifier-free guidance] -> expert flow
matching over that K/V -> unicycle integration -> Plan. The backend ("hf" reference or
"vllm") only changes who produces the reasoning and the K/V; everything else is shared.

Shapes: upstream returns pred_xyz (B, num_traj_sets, num_traj_samples, 64, 3); one request is
B = 1 with one set, so Plan.xyz (N, 64, 3) is upstream's [0, 0] and `plan.xyz[None, None]`
is the upstream layout.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from . import flow_matching
from .action_space import UnicycleActionSpace
from .backbone import Backbone, PromptInputs
from .checkpoint import load_backbone, load_expert, tensor_files
from .config import AlpamayoConfig
from .expert import ActionExpertModel
from .fp8_linear import fp8_kernel
from .frame_cache import FrameCache, frame_keys
from .preprocess import PreprocessedImages
from .prompt import build_prompt_inputs, remove_route_span, render_driving_prompt, render_vqa_prompt
from .tokenizer import AlpamayoTokenizer, extract_between, extract_reasoning
from .types import DrivingInput, Plan, PlanCancelled, SamplingSettings

logger = logging.getLogger(__name__)

BACKENDS = ("hf", "vllm")
#: Frames kept preprocessed across plans: two windows of 4 cameras x 4 frames.
DEFAULT_FRAME_CACHE = 32


@dataclass
class TextReply:
    """A VQA answer: the text between the answer tokens ("" if the model never closed it)."""

    answer: str
    text: str  # everything generated, special tokens included
    token_ids: list[int]


class Pipeline:
    """Alpamayo 1.5 inference on one backend; build it with from_checkpoint."""

    def __init__(
        self,
        config: AlpamayoConfig,
        tokenizer: AlpamayoTokenizer,
        backbone: Backbone,
        expert: ActionExpertModel,
        *,
        device: torch.device,
        frame_cache: int = DEFAULT_FRAME_CACHE,
    ) -> None:
        """frame_cache: frames kept preprocessed across plans (0: none)."""
        self.config = config
        self.tokenizer = tokenizer
        self.backbone = backbone
        self.expert = expert
        self.device = device
        self.action_space = UnicycleActionSpace(config.action_space)
        self.history_tokenizer = config.history_tokenizer()
        self.frames = FrameCache(
            config.vision,
            compute_device=device,
            store_device=backbone.pixel_device,
            capacity=frame_cache,
        )
        # GPU: padded length buckets so one captured CUDA graph (and compile) serves many
        # plans; CPU: exact lengths, eager.
        on_gpu = device.type == "cuda"
        # a backbone may run the expert itself (vLLM tensor parallel: in its workers)
        self.expert_sampler = getattr(backbone, "expert_sampler", None) or flow_matching.ExpertSampler(
            expert, bucket=256 if on_gpu else 1, compile_layers=on_gpu
        )
        # Cooperative stop (shutdown): checked between decode steps, flow steps and stages.
        self.stop = threading.Event()
        self.backbone.stop = self.stop
        self.expert_sampler.stop = self.stop

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        backend: str = "hf",
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        backend_options: dict[str, Any] | None = None,
        frame_cache: int = DEFAULT_FRAME_CACHE,
        expert_quantization: str = "none",
    ) -> Pipeline:
        """Load config, tokenizer, expert and the chosen backbone from a checkpoint directory.

        dtype defaults to the checkpoint's model_dtype. backend_options go to the vLLM
        backend's EngineOptions (the HF backend takes none). frame_cache: see __init__.
        expert_quantization: types.EXPERT_QUANTIZATIONS (FP8 copies of the expert's layer weights).
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        kernel = fp8_kernel(expert_quantization)
        if kernel is not None and (backend_options or {}).get("tensor_parallel_size", 1) > 1:
            raise ValueError("expert_quantization: not with tensor_parallel_size > 1 (the expert runs in vLLM's "
                             "workers there, in full precision)")
        config = AlpamayoConfig.from_checkpoint(path)
        device = torch.device(device)
        limit_host_threads(device)
        dtype = _dtype(dtype or config.model_dtype)
        tokenizer = AlpamayoTokenizer.from_checkpoint(path, config.traj_vocab_size)
        files = tensor_files(path)
        started = time.perf_counter()
        expert = load_expert(config, dtype=dtype, device=device, files=files)
        if kernel is not None:
            expert.quantize_fp8(kernel)
        if backend == "hf":
            if backend_options:
                raise ValueError(f"backend_options: the hf backend takes none, got {sorted(backend_options)}")
            from .backbone_hf import HFBackbone

            backbone = HFBackbone(load_backbone(config, dtype=dtype, device=device, files=files), tokenizer, config)
        else:
            from .backbone_vllm import EngineOptions, VLLMBackbone  # vLLM is optional

            options = EngineOptions(**{"dtype": str(dtype).removeprefix("torch."), **(backend_options or {})})
            backbone = VLLMBackbone(config, tokenizer.ids, options)
        logger.info(
            "loaded %s (%s backend, %s, %s) in %.1f s", path, backend, device, dtype, time.perf_counter() - started
        )
        return cls(config, tokenizer, backbone, expert, device=device, frame_cache=frame_cache)

    def cancel(self) -> None:
        """Stop the plan in flight at its next decode or flow step, and every later one
        (PlanCancelled); for shutdown, callable from any thread."""
        self.stop.set()

    def close(self) -> None:
        """Release the backend (the vLLM engine holds most of the GPU); the pipeline is unusable after.
        What warm_up froze is handed back to the collector, so the model can be freed (and
        native bindings do not report it as leaked when the process exits)."""
        close = getattr(self.backbone, "close", None)
        if close is not None:
            close()
        gc.unfreeze()

    # -- inputs --------------------------------------------------------------------------

    def preprocess(self, inputs: DrivingInput) -> PreprocessedImages:
        """All frames, camera-major then oldest first, resized for the vision tower (frames
        seen by an earlier plan come from the frame cache)."""
        cameras, frames = inputs.images.shape[:2]
        flat = inputs.images.reshape(cameras * frames, *inputs.images.shape[2:])
        return self.frames.preprocess(flat, frame_keys(inputs))

    def history_ids(self, inputs: DrivingInput) -> list[int]:
        """The 48 history token ids of the ego history."""
        bins = self.history_tokenizer.encode(torch.tensor(inputs.ego_history_xyz, dtype=torch.float32))
        return (bins + self.config.hist_token_start_idx).tolist()

    def driving_prompt(self, inputs: DrivingInput, images: PreprocessedImages) -> PromptInputs:
        """Render the trajectory prompt for inputs (with its route text, if any)."""
        ids = render_driving_prompt(
            self.tokenizer,
            camera_indices=inputs.camera_indices,
            frames_per_camera=inputs.images.shape[1],
            tokens_per_image=images.tokens_per_image,
            history_ids=self.history_ids(inputs),
            route_text=inputs.route_text,
        )
        return build_prompt_inputs(ids, images, image_token_id=self.tokenizer.ids.image_pad)

    # -- requests ------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, inputs: DrivingInput, settings: SamplingSettings) -> Plan:
        """One plan that pays what the first would (compilation, graph capture, allocations),
        then the heap as it stands frozen (gc.freeze): the model, compiled code and graphs
        are never traversed by a later generation-2 collection, whose pause on this heap is
        of the order of a plan. vLLM's engine does the same at its own start, before the expert
        and the graphs exist; close() (and closing vLLM's engine) unfreezes everything again."""
        plan = self.plan(inputs, settings)
        gc.collect()
        gc.freeze()
        return plan

    def plan(
        self,
        inputs: DrivingInput,
        settings: SamplingSettings = SamplingSettings(),
        *,
        forced_coc_ids: Sequence[int] | None = None,
        init_noise: torch.Tensor | None = None,
    ) -> Plan:
        """Reason, then sample settings.num_samples trajectories.

        forced_coc_ids: reasoning text ids to teacher-force instead of sampling; the rollout
            becomes them + <|cot_end|><|traj_future_start|> + one never-fed token.
        init_noise: standard-normal flow-matching start (num_samples, 64, 2) instead of a
            draw from the seeded generator.
        One seeded generator drives reasoning sampling, then the flow noise (upstream's order).
        """
        timings: dict[str, float] = {}
        total_start = time.perf_counter()
        self._check_stop()
        with self._timed(timings, "preprocess"):
            images = self.preprocess(inputs)
        with self._timed(timings, "prompt"):
            prompt = self.driving_prompt(inputs, images)
        generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        with self._timed(timings, "backbone"):
            rollout = self.backbone.rollout(
                prompt,
                num_samples=settings.num_samples,
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_new_tokens=settings.max_reasoning_tokens,
                generator=generator,
                forced_ids=self._forced_rollout(forced_coc_ids),
                min_new_tokens=settings.min_reasoning_tokens,
            )
        timings.update({f"backbone.{stage}": ms for stage, ms in rollout.timings_ms.items()})
        guided = settings.cfg_weight is not None and inputs.route_text is not None
        if settings.cfg_weight is not None and not guided:
            logger.debug("cfg_weight set but the input has no route_text: plain sampling")
        uncond_cache = None
        try:
            self._check_stop()
            if guided:
                with self._timed(timings, "cfg_prefill"):
                    free_ids = remove_route_span(prompt.input_ids.tolist(), self.tokenizer)
                    free_prompt = build_prompt_inputs(free_ids, images, image_token_id=self.tokenizer.ids.image_pad)
                    uncond_cache = self.backbone.prefill(free_prompt, rollout.generated_ids)
            with self._timed(timings, "expert"):
                action = self.expert_sampler.sample(
                    rollout.cache,
                    steps=settings.flow_steps,
                    noise_temperature=settings.noise_temperature,
                    generator=generator,
                    init_noise=init_noise,
                    uncond_cache=uncond_cache,
                    guidance_weight=settings.cfg_weight if guided else 1.0,
                )
        finally:
            # a paged backend (vLLM) holds the K/V in its cache until the expert is done with it
            paged = [cache for cache in (rollout.cache, uncond_cache) if cache is not None and cache.paged is not None]
            if paged:
                with self._timed(timings, "backbone.kv_release"):
                    for cache in paged:
                        cache.release()
        with self._timed(timings, "action"):
            # On the host: a few hundred scalars through ~100 tiny ops and a small SPD solve
            # take 0.2 ms there and ~3 ms as GPU kernel launches (bench/RESULTS.md). The rows
            # share one history, so its speed is fitted once for all of them.
            # copies (a few hundred bytes): a request's arrays may be read-only views of its body
            hist_xyz = torch.tensor(inputs.ego_history_xyz)[None]
            hist_rot = torch.tensor(inputs.ego_history_rot)[None]
            action = action.float().cpu()
            xyz, rot = self.action_space.action_to_traj(action, hist_xyz, hist_rot)
            accel, curvature = self.action_space.denormalize(action)
        timings["total"] = (time.perf_counter() - total_start) * 1e3
        reasoning = [
            extract_reasoning(self.tokenizer.decode([self.tokenizer.ids.special["cot_start"], *row]), "cot")
            for row in rollout.generated_ids
        ]
        return Plan(
            xyz=xyz.float().cpu().numpy(),
            rot=rot.float().cpu().numpy(),
            coc=[text for text, _ in reasoning],
            generated_ids=[list(row) for row in rollout.generated_ids],
            t0_ns=inputs.t0_ns,
            backend=self.backbone.name,
            timings_ms=timings,
            accel_mps2=accel.numpy(),
            curvature_per_m=curvature.numpy(),
            within_bounds=self.action_space.is_within_bounds(action).numpy(),
            reasoning_closed=[closed for _, closed in reasoning],
            drafted_tokens=rollout.drafted_tokens,
            accepted_tokens=rollout.accepted_tokens,
        )

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise PlanCancelled("plan cancelled: the pipeline is stopping")

    @torch.inference_mode()
    def generate_text(
        self,
        inputs: DrivingInput,
        question: str,
        settings: SamplingSettings = SamplingSettings(),
        *,
        max_new_tokens: int = 256,
    ) -> list[TextReply]:
        """Answer a question about the scene (upstream's VQA mode), one reply per sample.

        Uses settings' temperature, top_p, num_samples and seed; the ego history is not shown.
        """
        images = self.preprocess(inputs)
        ids = render_vqa_prompt(
            self.tokenizer,
            camera_indices=inputs.camera_indices,
            frames_per_camera=inputs.images.shape[1],
            tokens_per_image=images.tokens_per_image,
            question=question,
        )
        prompt = build_prompt_inputs(ids, images, image_token_id=self.tokenizer.ids.image_pad)
        rows = self.backbone.generate(
            prompt,
            num_samples=settings.num_samples,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_new_tokens=max_new_tokens,
            generator=torch.Generator(device=self.device).manual_seed(settings.seed),
        )
        answer_start = self.tokenizer.ids.special["answer_start"]
        replies = []
        for row in rows:
            text = self.tokenizer.decode(row)
            answer = extract_between(self.tokenizer.decode([answer_start, *row]), "answer")
            replies.append(TextReply(answer=answer, text=text, token_ids=list(row)))
        return replies

    def _forced_rollout(self, coc_ids: Sequence[int] | None) -> list[int] | None:
        if coc_ids is None:
            return None
        special = self.tokenizer.ids.special
        # the last token is the one upstream samples after the stop token and never feeds
        return [*coc_ids, special["cot_end"], special["traj_future_start"], self.tokenizer.ids.pad]

    @contextmanager
    def _timed(self, timings: dict[str, float], stage: str) -> Iterator[None]:
        """Wall time of a stage in ms; waits for the device so GPU work is counted where it ran.
        Also a profiler range (`pipeline.<stage>`), for torch.profiler traces of a plan."""
        start = time.perf_counter()
        with torch.profiler.record_function(f"pipeline.{stage}"):
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        timings[stage] = (time.perf_counter() - start) * 1e3


def limit_host_threads(device: torch.device) -> None:
    """Next to a GPU, run torch's host ops on one thread unless OMP_NUM_THREADS says otherwise.

    The host ops of a GPU plan are small, and a team of one OpenMP thread per core stalls at
    its barrier whenever another thread of the process (the engine's, CUDA's, frame hashing)
    holds a core: on an H100 host, preprocessing then took 43-60 ms at 13 cores of CPU time
    instead of 5 ms on one (bench/RESULTS.md, host probes). vLLM runs its own GPU workers with
    one torch thread for this reason; its in-process engine, which ours is, leaves it to us.
    """
    if device.type != "cuda" or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1:
        return
    logger.info("host threads: torch intra-op threads %d -> 1 beside the GPU (OMP_NUM_THREADS sets them)",
                torch.get_num_threads())
    torch.set_num_threads(1)


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch dtype name, got {value!r}")
    return dtype
