"""Pipeline.plan end to end on the tiny checkpoint (HF backend): shapes, seeds, noise, nav-CFG."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from alpamayo_ros.core.checkpoint import CheckpointError
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import main as make_checkpoint
from alpamayo_ros.core.types import SamplingSettings

COC = "The light ahead is red, so slow down and stop."
FAST = dict(max_reasoning_tokens=8)


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def scene(make_driving_input):
    return make_driving_input(frames=2, route_text="Turn right in 30m")


@pytest.fixture(scope="module")
def coc_ids(pipeline: Pipeline) -> list[int]:
    return pipeline.tokenizer.encode_text(COC)


def test_plan_shapes_and_provenance(pipeline: Pipeline, scene) -> None:
    plan = pipeline.plan(scene, SamplingSettings(num_samples=3, seed=1, **FAST))
    assert plan.xyz.shape == (3, 64, 3) and plan.xyz.dtype == np.float32
    assert plan.rot.shape == (3, 64, 3, 3) and plan.rot.dtype == np.float32
    assert plan.xyz[None, None].shape == (1, 1, 3, 64, 3)  # upstream's (B, sets, samples, 64, 3)
    assert np.isfinite(plan.xyz).all()
    np.testing.assert_allclose(
        plan.rot @ plan.rot.transpose(0, 1, 3, 2), np.broadcast_to(np.eye(3), (3, 64, 3, 3)), atol=1e-5
    )
    np.testing.assert_array_equal(plan.xyz[..., 2], 0.0)  # z held at the last history z
    assert len(plan.coc) == len(plan.generated_ids) == 3
    assert all(1 <= len(ids) <= 8 for ids in plan.generated_ids)
    assert (plan.t0_ns, plan.backend) == (scene.t0_ns, "hf")
    assert set(plan.timings_ms) == {
        "preprocess", "prompt", "backbone", "backbone.prefill", "backbone.decode", "backbone.kv_handoff",
        "expert", "action", "total",
    }
    assert plan.timings_ms["total"] >= plan.timings_ms["backbone"] > 0


READ_ONLY_PLAN = """
import pickle, sys, warnings
from pathlib import Path
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import SamplingSettings
warnings.simplefilter("error")  # torch warns once per process: a fresh one sees the first
inputs = pickle.loads(Path(sys.argv[2]).read_bytes())
for array in (inputs.images, inputs.ego_history_xyz, inputs.ego_history_rot):
    array.flags.writeable = False
pipeline = Pipeline.from_checkpoint(sys.argv[1], backend="hf", device="cpu", dtype="float32")
plan = pipeline.plan(inputs, SamplingSettings(num_samples=1, seed=4, max_reasoning_tokens=8))
Path(sys.argv[3]).write_bytes(pickle.dumps(plan.xyz))
"""


def test_read_only_inputs_plan_as_writable_ones_without_a_warning(
    pipeline: Pipeline, scene, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A server's request arrays are read-only views of its body: the plan is the same, and torch
    warns about nothing (its non-writable-array warning would print once per server process)."""
    (tmp_path / "inputs.pkl").write_bytes(pickle.dumps(scene))
    result = subprocess.run(
        [sys.executable, "-c", READ_ONLY_PLAN, str(tiny_checkpoint), str(tmp_path / "inputs.pkl"), str(tmp_path / "xyz.pkl")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    xyz = pickle.loads((tmp_path / "xyz.pkl").read_bytes())
    np.testing.assert_array_equal(xyz, pipeline.plan(scene, SamplingSettings(num_samples=1, seed=4, **FAST)).xyz)


def test_forced_reasoning_gives_its_coc(pipeline: Pipeline, scene, coc_ids: list[int]) -> None:
    plan = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=0), forced_coc_ids=coc_ids)
    special = pipeline.tokenizer.ids.special
    assert plan.coc == [COC, COC]
    assert plan.generated_ids == [[*coc_ids, special["cot_end"], special["traj_future_start"]]] * 2


def test_same_seed_same_plan_other_seed_other_plan(pipeline: Pipeline, scene) -> None:
    first = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=7, **FAST))
    again = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=7, **FAST))
    other = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=8, **FAST))
    np.testing.assert_array_equal(first.xyz, again.xyz)
    assert first.generated_ids == again.generated_ids
    assert not np.array_equal(first.xyz, other.xyz)
    assert first.generated_ids != other.generated_ids


def test_warm_up_plans_as_plan_and_takes_the_model_out_of_the_collectors_way(pipeline: Pipeline, scene) -> None:
    import gc

    settings = SamplingSettings(num_samples=1, seed=3, **FAST)
    expert_weight = next(pipeline.expert.parameters())
    assert any(obj is expert_weight for obj in gc.get_objects())  # traversed by every full collection
    try:
        warm = pipeline.warm_up(scene, settings)
        # frozen objects are left out of gc.get_objects(), as out of every later collection
        assert not any(obj is expert_weight for obj in gc.get_objects())
    finally:
        gc.unfreeze()  # the rest of this test process collects as before
    plain = pipeline.plan(scene, settings)
    np.testing.assert_array_equal(warm.xyz, plain.xyz)
    assert warm.generated_ids == plain.generated_ids


def test_injected_noise_is_the_noise_used(pipeline: Pipeline, scene, coc_ids: list[int]) -> None:
    # With forced reasoning nothing is sampled, so a seed's first draw is the flow noise.
    seeded = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=3), forced_coc_ids=coc_ids)
    noise = torch.randn((2, 64, 2), generator=torch.Generator().manual_seed(3))
    injected = pipeline.plan(scene, SamplingSettings(num_samples=2, seed=99), forced_coc_ids=coc_ids, init_noise=noise)
    np.testing.assert_array_equal(injected.xyz, seeded.xyz)
    colder = pipeline.plan(
        scene, SamplingSettings(num_samples=2, seed=99, noise_temperature=0.5), forced_coc_ids=coc_ids, init_noise=noise
    )
    assert not np.array_equal(colder.xyz, seeded.xyz)


def test_nav_cfg(pipeline: Pipeline, scene, coc_ids: list[int], make_driving_input) -> None:
    settings = dict(num_samples=2, seed=4)
    plain = pipeline.plan(scene, SamplingSettings(**settings), forced_coc_ids=coc_ids)
    weight_one = pipeline.plan(scene, SamplingSettings(cfg_weight=1.0, **settings), forced_coc_ids=coc_ids)
    guided = pipeline.plan(scene, SamplingSettings(cfg_weight=2.0, **settings), forced_coc_ids=coc_ids)
    assert "cfg_prefill" in weight_one.timings_ms and "cfg_prefill" not in plain.timings_ms
    np.testing.assert_array_equal(weight_one.xyz, plain.xyz)  # w = 1: conditional only
    assert not np.allclose(guided.xyz, plain.xyz, atol=1e-3)
    no_route = make_driving_input(frames=2)
    ignored = pipeline.plan(no_route, SamplingSettings(cfg_weight=2.0, **settings), forced_coc_ids=coc_ids)
    assert "cfg_prefill" not in ignored.timings_ms  # nothing to guide without a route


def test_route_changes_the_prompt_not_the_shapes(pipeline: Pipeline, scene, make_driving_input) -> None:
    no_route = make_driving_input(frames=2)
    with_route = pipeline.driving_prompt(scene, pipeline.preprocess(scene))
    without = pipeline.driving_prompt(no_route, pipeline.preprocess(no_route))
    route_start = pipeline.tokenizer.ids.special["route_start"]
    assert route_start in with_route.input_ids.tolist() and route_start not in without.input_ids.tolist()
    assert with_route.rope_delta == without.rope_delta == -2 * 162
    history = pipeline.history_ids(scene)
    assert len(history) == 48 and all(154669 <= token < 155669 for token in history)


def test_generate_text_answers_per_sample(pipeline: Pipeline, scene) -> None:
    replies = pipeline.generate_text(
        scene, "What is the ego vehicle doing?", SamplingSettings(num_samples=2, seed=0), max_new_tokens=6
    )
    assert len(replies) == 2
    for reply in replies:
        assert 1 <= len(reply.token_ids) <= 6
        assert reply.text == pipeline.tokenizer.decode(reply.token_ids)
        assert reply.answer == ""  # a random model never writes <|answer_end|>


def test_round_trip_from_a_clean_directory(tmp_path: Path, make_driving_input) -> None:
    make_checkpoint([str(tmp_path / "ckpt"), "--seed", "3"])
    pipeline = Pipeline.from_checkpoint(tmp_path / "ckpt")
    plan = pipeline.plan(make_driving_input(frames=1), SamplingSettings(num_samples=1, **FAST))
    assert plan.xyz.shape == (1, 64, 3) and np.isfinite(plan.xyz).all()


def test_tensor_errors_name_the_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    missing = dict(tensors)
    del missing["action_in_proj.norm.weight"]
    unexpected = dict(tensors)
    unexpected["vlm.model.language_model.layers.4.mlp.up_proj.weight"] = torch.zeros(128, 64)
    for name, variant, message in (
        ("missing", missing, r"1 missing: action_in_proj.norm.weight"),
        ("unexpected", unexpected, r"1 unexpected: vlm.model.language_model.layers.4.mlp.up_proj.weight"),
    ):
        target = tmp_path / name
        shutil.copytree(tiny_checkpoint, target, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(variant, str(target / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            Pipeline.from_checkpoint(target)


def test_bad_backend_arguments(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"backend: expected one of \('hf', 'vllm'\), got 'onnx'"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="onnx")
    with pytest.raises(ValueError, match="backend_options: the hf backend takes none"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend_options={"max_model_len": 4096})
    with pytest.raises(ValueError, match="dtype: expected a floating torch dtype name, got 'int8'"):
        Pipeline.from_checkpoint(tiny_checkpoint, dtype="int8")


@pytest.mark.parametrize(
    ("device", "omp", "expected"),
    [("cuda", None, "1"), ("cuda", "2", "2"), ("cpu", None, "2")],
)
def test_gpu_pipelines_run_host_ops_on_one_torch_thread_unless_omp_num_threads_says(device, omp, expected) -> None:
    """limit_host_threads, in a fresh process per case (it changes a process-wide setting): next to
    a GPU torch keeps one intra-op thread, unless OMP_NUM_THREADS was set; on the CPU it is left."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = (
        "import torch; torch.set_num_threads(2); "
        "from alpamayo_ros.core.pipeline import limit_host_threads; "
        f"limit_host_threads(torch.device({device!r})); print(torch.get_num_threads())"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == expected
