"""The reasoning text of a plan is what the model generated, closed by <|cot_end|> or not,
and the node's Reasoning message says which (closed / sample_closed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rclpy.parameter import Parameter
from safetensors.torch import load_file, save_file

from alpamayo_ros.testing.rig import (
    CameraFeed,
    RosSide,
    SensorRig,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tokenizer import AlpamayoTokenizer, extract_reasoning
from alpamayo_ros.core.types import SamplingSettings
from alpamayo_ros_msgs.msg import Reasoning

WORD = "Stop"  # the one word the scripted checkpoint reasons with
LOGIT = 100.0  # far above every other logit (all 0)
TIMEOUT_S = 600.0  # hang guard only: the model stack import alone took 155 s on a loaded 2-core machine


def reasoning_checkpoint(source: Path, target: Path) -> Path:
    """A copy of the tiny checkpoint whose backbone always reasons "<|cot_start|>Stop<|cot_end|>
    <|traj_future_start|>": the decoder layers add nothing, so the hidden state of a step is the
    embedding of its input token, and three embedding dimensions pick the next token through
    lm_head (cot_start -> Stop -> cot_end -> traj_future_start). A budget of 1 token cuts it open.
    """
    shutil.copytree(source, target)
    ids = AlpamayoTokenizer.from_checkpoint(target).ids.special
    (word,) = AlpamayoTokenizer.from_checkpoint(target).encode_text(WORD)
    weights_path = target / "model.safetensors"
    weights = load_file(weights_path)
    prefix = "vlm.model.language_model."
    for name, tensor in weights.items():
        if name.startswith(prefix + "layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, head = weights[prefix + "embed_tokens.weight"], weights["vlm.lm_head.weight"]
    embed[:, :3] = 0.0
    head.zero_()
    weights[prefix + "norm.weight"][:3] = 1.0
    for dim, (current, following) in enumerate(
        [(ids["cot_start"], word), (word, ids["cot_end"]), (ids["cot_end"], ids["traj_future_start"])]
    ):
        embed[current, dim] = 1.0
        head[following, dim] = LOGIT
    save_file(weights, weights_path)
    return target


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<|cot_start|> Red light ahead. <|cot_end|><|traj_future_start|>", ("Red light ahead.", True)),
        ("<|cot_start|>a<|cot_start|> b <|cot_end|>c<|cot_end|>", ("b", True)),  # upstream's rule when closed
        ("<|cot_start|> Slowing for the cyclist", ("Slowing for the cyclist", False)),  # token budget ran out
        ("<|cot_start|>", ("", False)),
    ],
)
def test_extract_reasoning(text: str, expected: tuple[str, bool]) -> None:
    assert extract_reasoning(text, "cot") == expected


def test_a_plan_cut_at_the_token_budget_carries_its_text(tiny_checkpoint, make_driving_input) -> None:
    pipeline = Pipeline.from_checkpoint(str(tiny_checkpoint), backend="hf", device="cpu")
    plan = pipeline.plan(make_driving_input(height=64, width=96), SamplingSettings(num_samples=2, max_reasoning_tokens=3))
    assert plan.reasoning_closed == [False, False]
    for text, ids in zip(plan.coc, plan.generated_ids):
        assert len(ids) == 3 and text and text == pipeline.tokenizer.decode(ids).strip()


def test_the_node_says_whether_the_reasoning_closed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A real node on the scripted checkpoint: 1 token cuts the reasoning ("Stop", closed false),
    8 tokens let it close ("Stop", closed true); the text is published either way."""
    checkpoint = reasoning_checkpoint(tiny_checkpoint, tmp_path / "checkpoint")
    side = RosSide(unique_domain_id(), "reasoning_test")
    cameras = [CameraFeed(1, "/rt/front", "raw")]
    params = write_params_file(tmp_path / "drive.yaml", {
        "model.checkpoint_path": str(checkpoint), "cameras.topics": [cameras[0].topic], "cameras.indices": [1],
        "cameras.transports": ["raw"], "odometry.topic": "/rt/odom", "sampling.num_samples": 2,
        "sampling.max_reasoning_tokens": 1, "sampling.flow_steps": 2, "cameras.max_age_s": 1.0,
    })  # fmt: skip
    reasoning = side.collect(Reasoning, "/alpamayo_drive/output/reasoning", side.reliable(depth=100))
    rig = SensorRig(side, cameras, odometry_topic="/rt/odom").start()
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(side.context.get_domain_id(), OMP_NUM_THREADS="1"),
                                   log_path=log, params_file=params)  # fmt: skip
    try:
        assert wait_until(lambda: len(reasoning) >= 1, TIMEOUT_S), log.read_text(errors="replace")[-4000:]
        cut = reasoning.messages[0]
        assert (cut.coc, cut.closed, cut.generated_tokens) == (WORD, False, 1)
        assert (list(cut.sample_cocs), list(cut.sample_closed)) == ([WORD, WORD], [False, False])

        (result,) = side.set_parameters("alpamayo_drive", [Parameter("sampling.max_reasoning_tokens", value=8)])
        assert result.successful, result.reason
        assert wait_until(lambda: any(m.closed for m in reasoning.messages), TIMEOUT_S), log.read_text()[-4000:]
        closed = next(m for m in reasoning.messages if m.closed)
        assert (closed.coc, closed.generated_tokens) == (WORD, 3)  # Stop, <|cot_end|>, <|traj_future_start|>
        assert (list(closed.sample_cocs), list(closed.sample_closed)) == ([WORD, WORD], [True, True])
    finally:
        rig.stop()
        code = stop_process(process, timeout_s=40)
        side.close()
    assert code == 0, log.read_text(errors="replace")[-4000:]
