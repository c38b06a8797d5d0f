"""Alpamayo 1.5's prompt, rendered straight to token ids, and its M-RoPE positions.

Upstream builds chat messages and renders them with the Qwen3-VL chat template, then the
processor expands every image placeholder. Templates and processors change across
transformers releases (the same messages gave 152 tokens under one release and 147 under the
next), so we write the rendered layout down once, here:

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n<|im_start|>user\\n
    per camera: "{display name}: ", then per frame k: "frame {k} " <|vision_start|> n*<|image_pad|> <|vision_end|>
    <|traj_history_start|> 48 history tokens <|traj_history_end|> [<|route_start|>{route}<|route_end|>]
    {instruction}<|im_end|>\\n<|im_start|>assistant\\n<|cot_start|>

Text between two special tokens is encoded as one piece, exactly as a tokenizer splits the
rendered string. The VQA layout swaps the history/route/instruction for
`<|question_start|>{q}<|question_end|>` and the assistant prefix for `<|answer_start|>`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .backbone import PromptInputs
from .preprocess import PreprocessedImages
from .tokenizer import AlpamayoTokenizer
from .types import CAMERAS

SYSTEM_PROMPT = "You are a driving assistant that generates safe and accurate actions."
TRAJECTORY_INSTRUCTION = (
    "output the chain-of-thought reasoning of the driving process, then output the future trajectory."
)


class CallerText(NamedTuple):
    """Text that came from the caller (route, question): named in errors, never trusted."""

    text: str
    source: str  # input name, e.g. "route_text"


Piece = str | int | tuple[int, ...] | CallerText  # fixed text, token id(s), or caller text


def _image_pieces(
    tokenizer: AlpamayoTokenizer,
    camera_indices: Sequence[int],
    frames_per_camera: int,
    tokens_per_image: Sequence[int],
) -> list[Piece]:
    """Camera names, frame numbers and the expanded image placeholders, camera-major."""
    if frames_per_camera < 1:
        raise ValueError(f"frames_per_camera: must be >= 1, got {frames_per_camera}")
    expected = len(camera_indices) * frames_per_camera
    if len(tokens_per_image) != expected:
        raise ValueError(
            f"tokens_per_image: {len(tokens_per_image)} images for {len(camera_indices)} cameras x "
            f"{frames_per_camera} frames"
        )
    ids = tokenizer.ids
    pieces: list[Piece] = []
    for camera_number, camera_index in enumerate(camera_indices):
        if camera_index not in CAMERAS:
            raise ValueError(f"camera_indices: unknown camera index {camera_index}")
        pieces.append(f"{CAMERAS[camera_index][1]}: ")
        for frame in range(frames_per_camera):
            count = tokens_per_image[camera_number * frames_per_camera + frame]
            pieces += [f"frame {frame} ", ids.vision_start, (ids.image_pad,) * count, ids.vision_end]
    return pieces


def _encode(tokenizer: AlpamayoTokenizer, pieces: Sequence[Piece]) -> list[int]:
    """Encode pieces, joining neighbouring text so it is tokenized as one span."""
    out: list[int] = []
    text: list[str] = []
    source = "prompt text"
    for piece in pieces:
        if isinstance(piece, CallerText):
            text.append(piece.text)
            source = piece.source
        elif isinstance(piece, str):
            text.append(piece)
        else:
            if text:
                out += tokenizer.encode_text("".join(text), source=source)
                text, source = [], "prompt text"
            if isinstance(piece, tuple):  # an image's placeholder run: one piece, not thousands
                out.extend(piece)
            else:
                out.append(piece)
    if text:
        out += tokenizer.encode_text("".join(text), source=source)
    return out


def _chat(tokenizer: AlpamayoTokenizer, user: list[Piece], assistant_prefix: str) -> list[Piece]:
    ids = tokenizer.ids
    return [
        ids.im_start, f"system\n{SYSTEM_PROMPT}", ids.im_end, "\n",
        ids.im_start, "user\n", *user, ids.im_end, "\n",
        ids.im_start, "assistant\n", ids.special[assistant_prefix],
    ]  # fmt: skip


def render_driving_prompt(
    tokenizer: AlpamayoTokenizer,
    *,
    camera_indices: Sequence[int],
    frames_per_camera: int,
    tokens_per_image: Sequence[int],
    history_ids: Sequence[int],
    route_text: str | None = None,
) -> list[int]:
    """Token ids of the trajectory prompt (history tokens already in place)."""
    if not history_ids:
        raise ValueError("history_ids: empty")
    special = tokenizer.ids.special
    user = _image_pieces(tokenizer, camera_indices, frames_per_camera, tokens_per_image)
    user += [special["traj_history_start"], *history_ids, special["traj_history_end"]]
    if route_text is not None:
        if not route_text.strip():
            raise ValueError("route_text: empty; pass None for no route")
        user += [special["route_start"], CallerText(route_text, "route_text"), special["route_end"]]
    user.append(TRAJECTORY_INSTRUCTION)
    return _encode(tokenizer, _chat(tokenizer, user, "cot_start"))


def render_vqa_prompt(
    tokenizer: AlpamayoTokenizer,
    *,
    camera_indices: Sequence[int],
    frames_per_camera: int,
    tokens_per_image: Sequence[int],
    question: str,
) -> list[int]:
    """Token ids of the visual question-answering prompt (upstream's create_vqa_message)."""
    if not question.strip():
        raise ValueError("question: empty")
    special = tokenizer.ids.special
    user = _image_pieces(tokenizer, camera_indices, frames_per_camera, tokens_per_image)
    user += [special["question_start"], CallerText(question, "question"), special["question_end"]]
    return _encode(tokenizer, _chat(tokenizer, user, "answer_start"))


def remove_route_span(input_ids: Sequence[int], tokenizer: AlpamayoTokenizer) -> list[int]:
    """Drop `<|route_start|>` ... `<|route_end|>` (inclusive): the prompt nav-CFG calls unguided."""
    special = tokenizer.ids.special
    ids = list(input_ids)
    try:
        start = ids.index(special["route_start"])
        end = ids.index(special["route_end"], start)
    except ValueError:
        raise ValueError("input_ids: no <|route_start|>...<|route_end|> span to remove") from None
    return ids[:start] + ids[end + 1 :]


def mrope_positions(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor, *, image_token_id: int, merge_size: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions (3, T) of one prompt and its rope delta (next position - T).

    Text advances all three axes by one per token. An image block of (t, h, w) patches takes
    (temporal, row, column) positions start + index over its merged grid, and moves the
    cursor by max(h, w) / merge_size, so each 20x36-patch camera frame (180 tokens) uses 18
    positions and the delta goes strongly negative.
    """
    if input_ids.ndim != 1:
        raise ValueError(f"input_ids: expected (T,), got {tuple(input_ids.shape)}")
    is_image = (input_ids == image_token_id).cpu()
    length = int(input_ids.shape[0])
    change = torch.nonzero(is_image[1:] != is_image[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), length]
    grids = image_grid_thw.tolist()
    positions: list[torch.Tensor] = []
    cursor = 0
    image_index = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if not is_image[start]:
            positions.append(torch.arange(cursor, cursor + end - start).expand(3, -1))
            cursor += end - start
            continue
        if image_index >= len(grids):
            raise ValueError(f"image_grid_thw: {len(grids)} grids for more image blocks in input_ids")
        t, h, w = grids[image_index]
        grid_h, grid_w = h // merge_size, w // merge_size
        if end - start != t * grid_h * grid_w:
            raise ValueError(
                f"input_ids: image block {image_index} has {end - start} tokens, grid {grids[image_index]} "
                f"needs {t * grid_h * grid_w}"
            )
        temporal, rows, cols = torch.meshgrid(
            torch.arange(t), torch.arange(grid_h), torch.arange(grid_w), indexing="ij"
        )
        positions.append(torch.stack([temporal, rows, cols]).reshape(3, -1) + cursor)
        cursor += max(h, w) // merge_size
        image_index += 1
    if image_index != len(grids):
        raise ValueError(f"image_grid_thw: {len(grids)} grids but {image_index} image blocks in input_ids")
    position_ids = torch.cat(positions, dim=1) if positions else torch.zeros(3, 0, dtype=torch.long)
    rope_delta = int(position_ids.max()) + 1 - length if length else 0
    return position_ids.to(input_ids.device), rope_delta


def build_prompt_inputs(input_ids: Sequence[int], images: PreprocessedImages, *, image_token_id: int) -> PromptInputs:
    """Bundle rendered ids with the preprocessed frames and their M-RoPE positions."""
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=images.frames.device)
    position_ids, rope_delta = mrope_positions(
        ids, images.image_grid_thw, image_token_id=image_token_id, merge_size=images.merge_size
    )
    return PromptInputs(input_ids=ids, images=images, position_ids=position_ids, rope_delta=rope_delta)
