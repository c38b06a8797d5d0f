"""HF backbone: our decode loop equals transformers' generate() run with upstream's settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alpamayo_ros.core.backbone import PromptInputs
from alpamayo_ros.core.backbone_hf import HFBackbone
from alpamayo_ros.core.checkpoint import load_backbone
from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tokenizer import AlpamayoTokenizer


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def prompt(pipeline: Pipeline, make_driving_input) -> PromptInputs:
    inputs = make_driving_input(frames=2, route_text="Turn right in 30m")
    return pipeline.driving_prompt(inputs, pipeline.preprocess(inputs))


@pytest.fixture(scope="module")
def stopping_backbone(tiny_checkpoint: Path, prompt: PromptInputs) -> HFBackbone:
    """The tiny backbone with an lm_head that likes only 5 tokens, <|traj_future_start|> and
    <|im_end|> among them, so sampled rows stop (or end) at different steps.

    Their rows point along the mean final hidden state of the prompt, with logits well above
    the ~155k zeroed rows, and slightly different offsets.
    """
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    tokenizer = AlpamayoTokenizer.from_checkpoint(tiny_checkpoint)
    model = load_backbone(config, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        hidden = model.model(
            input_ids=prompt.input_ids[None],
            position_ids=prompt.position_ids[:, None],
            pixel_values=prompt.images.patches("cpu", torch.float32),
            image_grid_thw=prompt.images.image_grid_thw,
        ).last_hidden_state[0]
    direction = hidden.mean(dim=0) / hidden.mean(dim=0).norm()
    typical = (hidden @ direction).mean()
    ids = tokenizer.ids
    liked = [ids.traj_future_start, ids.im_end, 9707, 1879, 13]
    weight = model.lm_head.weight.detach()
    own = weight[liked] / weight[liked].norm(dim=1, keepdim=True)
    weight.zero_()
    for token, row, logit in zip(liked, own, (20.0, 19.0, 20.5, 20.3, 20.8)):
        weight[token] = direction * (logit / typical) + 0.05 * row
    return HFBackbone(model, tokenizer, config)


def reference_generate(
    backbone: HFBackbone,
    prompt: PromptInputs,
    *,
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    mask_and_stop: bool = True,
):
    """transformers' generate() with upstream's logits processor and stopping criterion."""
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    ids = backbone.tokenizer.ids

    class MaskTrajectoryBins(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scores[:, ids.traj_start : ids.traj_start + ids.traj_vocab_size] = float("-inf")
            return scores

    class StopOneAfterAllRows(StoppingCriteria):
        def __init__(self) -> None:
            self.found: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> bool:
            if self.found is None:
                self.found = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            if self.found.all():
                return True
            self.found |= input_ids[:, -1] == ids.traj_future_start
            return False

    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    extra = {}
    if mask_and_stop:
        extra = dict(
            logits_processor=LogitsProcessorList([MaskTrajectoryBins()]),
            stopping_criteria=StoppingCriteriaList([StopOneAfterAllRows()]),
        )
    out = backbone.model.generate(
        input_ids=prompt.input_ids[None],
        pixel_values=prompt.images.patches("cpu", torch.float32),
        image_grid_thw=prompt.images.image_grid_thw,
        mm_token_type_ids=(prompt.input_ids == ids.image_pad).int()[None],
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_samples,
        top_k=None,
        eos_token_id=ids.im_end,
        pad_token_id=ids.pad,
        return_dict_in_generate=True,
        **sampling,
        **extra,
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    return out.sequences[:, prompt.input_ids.shape[0] :], cache


def assert_cache_equal(ours, theirs, atol: float = 0.0) -> None:
    assert len(ours.keys) == len(theirs.layers)
    for layer, (keys, values) in enumerate(zip(ours.keys, ours.values)):
        assert keys.shape == theirs.layers[layer].keys.shape, f"layer {layer}"
        torch.testing.assert_close(keys, theirs.layers[layer].keys, atol=atol, rtol=0)
        torch.testing.assert_close(values, theirs.layers[layer].values, atol=atol, rtol=0)


def test_greedy_rollout_equals_generate(pipeline: Pipeline, prompt: PromptInputs) -> None:
    backbone = pipeline.backbone
    rollout = backbone.rollout(
        prompt,
        num_samples=1,
        temperature=0.0,
        top_p=0.98,
        max_new_tokens=12,
        generator=torch.Generator().manual_seed(0),
    )
    sequences, cache = reference_generate(
        backbone, prompt, num_samples=1, temperature=0.0, top_p=0.98, max_new_tokens=12, seed=0
    )
    assert rollout.generated_ids == sequences.tolist()
    assert len(set(rollout.generated_ids[0])) > 3  # the tiny model does not repeat one token
    prompt_len = prompt.input_ids.shape[0]
    assert rollout.cache.length == prompt_len + 11  # the last token is never fed
    assert rollout.cache.offsets.tolist() == [prompt_len + 12]  # no stop token: all attended
    assert rollout.cache.rope_deltas.tolist() == [prompt.rope_delta]
    assert_cache_equal(rollout.cache, cache)


@pytest.mark.parametrize("seed", [0, 2])
def test_sampled_rollout_with_stops_equals_generate(
    stopping_backbone: HFBackbone, prompt: PromptInputs, seed: int
) -> None:
    ids = stopping_backbone.tokenizer.ids
    rollout = stopping_backbone.rollout(
        prompt,
        num_samples=4,
        temperature=1.0,
        top_p=0.98,
        max_new_tokens=16,
        generator=torch.Generator().manual_seed(seed),
    )
    sequences, cache = reference_generate(
        stopping_backbone, prompt, num_samples=4, temperature=1.0, top_p=0.98, max_new_tokens=16, seed=seed
    )
    prompt_len = prompt.input_ids.shape[0]
    steps = sequences.shape[1]
    assert rollout.cache.length == prompt_len + steps - 1
    assert_cache_equal(rollout.cache, cache)
    stop_steps = []
    for row, (generated, full) in enumerate(zip(rollout.generated_ids, sequences.tolist())):
        if ids.traj_future_start in full:
            stop = full.index(ids.traj_future_start)
            stop_steps.append(stop)
            assert generated == full[: stop + 1]
            assert rollout.cache.offsets[row] == prompt_len + stop + 1
        else:  # ended by <|im_end|> (then pads) or by the token limit
            assert generated == full
            assert rollout.cache.offsets[row] == prompt_len + steps
    assert len(set(stop_steps)) > 1, "rows should stop at different steps"
    if len(stop_steps) == 4:  # every row stopped: one more token after the last stop, then done
        assert steps == max(stop_steps) + 2 < 16
    else:  # a row ended on <|im_end|> without stopping: upstream runs to the token limit
        ended = [row for row in sequences.tolist() if ids.im_end in row]
        assert ended and all(set(row[row.index(ids.im_end) + 1 :]) == {ids.pad} for row in ended)
        assert steps == 16


def test_prefill_reproduces_the_rollout_cache(stopping_backbone: HFBackbone, prompt: PromptInputs) -> None:
    rollout = stopping_backbone.rollout(
        prompt, num_samples=4, temperature=1.0, top_p=1.0, max_new_tokens=16, generator=torch.Generator().manual_seed(2)
    )
    prefilled = stopping_backbone.prefill(prompt, rollout.generated_ids)
    assert torch.equal(prefilled.offsets, rollout.cache.offsets)
    for row in range(len(rollout.generated_ids)):
        end = min(int(rollout.cache.offsets[row]), rollout.cache.length)  # columns the expert attends to
        for layer in range(len(prefilled.keys)):
            torch.testing.assert_close(
                prefilled.keys[layer][row, :, :end], rollout.cache.keys[layer][row, :, :end], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                prefilled.values[layer][row, :, :end], rollout.cache.values[layer][row, :, :end], atol=1e-5, rtol=1e-5
            )


def test_prefill_equals_a_plain_forward(pipeline: Pipeline, prompt: PromptInputs) -> None:
    backbone = pipeline.backbone
    rows = [[9707, 1879, 13], [15, 155681]]
    prefilled = backbone.prefill(prompt, rows)
    prompt_len = prompt.input_ids.shape[0]
    assert prefilled.offsets.tolist() == [prompt_len + 3, prompt_len + 2]
    for row, tokens in enumerate(rows):
        full = torch.cat([prompt.input_ids, torch.tensor(tokens)])
        with torch.inference_mode():
            out = backbone.model(
                input_ids=full[None],
                pixel_values=prompt.images.patches("cpu", torch.float32),
                image_grid_thw=prompt.images.image_grid_thw,
                mm_token_type_ids=(full == backbone.tokenizer.ids.image_pad).int()[None],
                use_cache=True,
            )
        cache = getattr(out, "cache", None) or out.past_key_values
        length = prompt_len + len(tokens)
        for layer in range(len(prefilled.keys)):
            torch.testing.assert_close(
                prefilled.keys[layer][row, :, :length], cache.layers[layer].keys[0], atol=1e-5, rtol=1e-5
            )


def test_forced_ids_are_teacher_forced(pipeline: Pipeline, prompt: PromptInputs) -> None:
    backbone = pipeline.backbone
    forced = [9707, 1879, 155678, 155681, 151643]
    rollout = backbone.rollout(
        prompt,
        num_samples=2,
        temperature=0.6,
        top_p=0.98,
        max_new_tokens=3,
        generator=torch.Generator().manual_seed(0),
        forced_ids=forced,
    )
    prompt_len = prompt.input_ids.shape[0]
    assert rollout.generated_ids == [forced[:4]] * 2
    assert rollout.cache.length == prompt_len + 4
    assert rollout.cache.offsets.tolist() == [prompt_len + 4] * 2
    prefilled = backbone.prefill(prompt, [forced[:4]])
    torch.testing.assert_close(rollout.cache.keys[0][:1], prefilled.keys[0], atol=1e-5, rtol=1e-5)


def test_generate_is_plain_sampling(pipeline: Pipeline, prompt: PromptInputs) -> None:
    backbone = pipeline.backbone
    rows = backbone.generate(
        prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=6, generator=torch.Generator()
    )
    sequences, _ = reference_generate(
        backbone, prompt, num_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0, mask_and_stop=False
    )
    assert rows == sequences.tolist()


def test_bad_sampling_arguments_are_named(pipeline: Pipeline, prompt: PromptInputs) -> None:
    backbone = pipeline.backbone
    common = dict(temperature=0.6, top_p=0.98, max_new_tokens=4, generator=torch.Generator())
    with pytest.raises(ValueError, match="num_samples: must be >= 1"):
        backbone.rollout(prompt, num_samples=0, **common)
    with pytest.raises(ValueError, match=r"top_p: must be in \(0, 1\]"):
        backbone.rollout(prompt, num_samples=1, **{**common, "top_p": 0.0})
    with pytest.raises(ValueError, match="forced_ids: empty"):
        backbone.rollout(prompt, num_samples=1, forced_ids=[], **common)
    with pytest.raises(ValueError, match="generated_ids"):
        backbone.prefill(prompt, [])
