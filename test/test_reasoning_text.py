"""The reasoning text of a plan is what the model generated, closed by <|cot_end|> or not."""

from __future__ import annotations

import pytest

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tokenizer import extract_reasoning
from alpamayo_ros.core.types import SamplingSettings


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
