"""Extended tokenizer: upstream's id table, the saved files, and text handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from alpamayo_ros.core.tokenizer import (
    SPECIAL_TOKEN_KEYS,
    AlpamayoTokenizer,
    extract_between,
    qwen3_tokenizer_dir,
    special_token,
)

# Upstream ids (model facts 1.3, confirmed against the released embedding size 155697).
EXPECTED_SPECIAL_IDS = {
    "prompt_start": 155669, "prompt_end": 155670, "image_start": 155671, "_padding_0": 155672,
    "image_end": 155673, "traj_history_start": 155674, "_padding_1": 155675,
    "traj_history_end": 155676, "cot_start": 155677, "cot_end": 155678, "_padding_2": 155679,
    "_padding_3": 155680, "traj_future_start": 155681, "_padding_4": 155682,
    "traj_future_end": 155683, "traj_history": 155684, "traj_future": 155685, "image_pad": 151655,
    "_padding_5": 155686, "_padding_6": 155687, "_padding_7": 155688, "_padding_8": 155689,
    "route_start": 155690, "route_pad": 155691, "route_end": 155692, "question_start": 155693,
    "question_end": 155694, "answer_start": 155695, "answer_end": 155696,
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> AlpamayoTokenizer:
    return AlpamayoTokenizer.from_checkpoint(tiny_checkpoint)


def test_id_table_matches_upstream(tokenizer: AlpamayoTokenizer) -> None:
    assert len(tokenizer) == 155697
    assert tokenizer.token_id("<i0>") == 151669
    assert tokenizer.token_id("<i3000>") == 154669  # first history bin
    assert tokenizer.token_id("<i3999>") == 155668
    assert tokenizer.ids.special == EXPECTED_SPECIAL_IDS
    assert list(tokenizer.ids.special) == list(SPECIAL_TOKEN_KEYS)
    for key, token_id in EXPECTED_SPECIAL_IDS.items():
        assert tokenizer.token_id(special_token(key)) == token_id
    ids = tokenizer.ids
    assert (ids.pad, ids.im_start, ids.im_end) == (151643, 151644, 151645)
    assert (ids.vision_start, ids.vision_end, ids.image_pad) == (151652, 151653, 151655)
    assert ids.traj_future_start == 155681


def test_text_encodes_like_qwen3(tokenizer: AlpamayoTokenizer) -> None:
    assert tokenizer.encode_text("Hello world") == [9707, 1879]
    text = "Front camera: frame 0 "
    assert tokenizer.decode(tokenizer.encode_text(text)) == text


def test_saved_files_load_in_transformers_with_the_same_ids(
    tiny_checkpoint: Path, tokenizer: AlpamayoTokenizer
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_checkpoint), local_files_only=True)
    assert len(hf) == 155697
    text = "<|cot_start|>Slow down for the <i12> cyclist.<|cot_end|><|traj_future_start|>"
    assert hf.encode(text, add_special_tokens=False) == [
        155677,
        *tokenizer.encode_text("Slow down for the "),
        151681,
        *tokenizer.encode_text(" cyclist."),
        155678,
        155681,
    ]
    assert hf.decode([155677, 9707, 155678], skip_special_tokens=False) == tokenizer.decode([155677, 9707, 155678])
    assert "<|vision_start|><|image_pad|><|vision_end|>" in hf.chat_template
    assert json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_checkpoint_without_tokenizer_builds_the_same_table(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    built = AlpamayoTokenizer.from_checkpoint(tmp_path)
    assert built.ids == AlpamayoTokenizer.from_checkpoint(tiny_checkpoint).ids
    assert built.encode_text("Turn right in 30m") == AlpamayoTokenizer.from_checkpoint(tiny_checkpoint).encode_text(
        "Turn right in 30m"
    )


def test_wrong_trajectory_vocabulary_is_rejected(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"'<\|prompt_start\|>' has id 155669, expected 152437"):
        AlpamayoTokenizer.from_checkpoint(tiny_checkpoint, traj_vocab_size=768)


def test_special_tokens_in_caller_text_are_refused(tokenizer: AlpamayoTokenizer) -> None:
    with pytest.raises(ValueError, match=r"route_text: must not contain special tokens.*traj_future_start"):
        tokenizer.encode_text("Turn right<|traj_future_start|>", source="route_text")
    with pytest.raises(ValueError, match="im_end"):
        tokenizer.encode_text("a<|im_end|>b")


def test_base_files_come_from_the_wheel() -> None:
    directory = qwen3_tokenizer_dir()
    assert (directory / "tokenizer.json").stat().st_size > 10_000_000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<|cot_start|> Red light ahead. <|cot_end|><|traj_future_start|>", "Red light ahead."),
        ("<|cot_start|>a<|cot_start|> b <|cot_end|>c<|cot_end|>", "b"),  # last start before first end
        ("<|cot_start|>never closed", ""),
        ("no start <|cot_end|>", "no start"),
    ],
)
def test_extract_between_follows_upstream(text: str, expected: str) -> None:
    assert extract_between(text, "cot") == expected
