"""The <i*> logits mask as a per-request vLLM logits processor (TokenMask) and its spec.

A batch-level processor is needed only for a minimum length below the maximum; otherwise
the model masks in compute_logits (model.py), which keeps vLLM's async scheduling overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

MASK_KEY = "alpamayo_mask"  # SamplingParams.extra_args key, see TokenMask


@dataclass(frozen=True)
class MaskSpec:
    """What TokenMask hides from one request.

    ids [start, end) always (upstream's <i*> mask); early_ids while the request has fewer
    than min_tokens outputs (fixed-length benchmarks keep the stop and end tokens away).
    """

    start: int
    end: int
    min_tokens: int = 0
    early_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"mask ids: expected 0 <= start <= end, got [{self.start}, {self.end})")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")


class TokenMask(LogitsProcessor):
    """Sets the logits a request's MaskSpec names to -inf, before temperature and top-p.

    Upstream masks in a logits processor too. One fill per distinct range and step. It runs
    on the engine's critical path every step, so it never waits for the GPU itself: index
    tensors are uploaded only when the rows or ids change, from pinned memory without a
    stream sync, and a range covering the whole batch is a plain slice fill.
    NOTE: registering any custom logits processor still makes vLLM keep every request's
    output ids on the host and wait for the previous step's tokens before sampling: on an
    H200 that costs ~1.4-2.1 ms per decode step (bench/RESULTS.md, decode probe).
    allowed_token_ids would avoid it, but vLLM 0.26 (GPU) caps it at 1024 ids and this mask
    allows ~151k. EngineOptions.mask_in_model masks in the model instead (no processor).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._device = device
        self._pin = is_pin_memory
        self._specs: dict[int, tuple[MaskSpec, list[int]]] = {}  # batch row -> (spec, its output ids)
        self._ranges: list[tuple[list[int], torch.Tensor, int, int]] = []  # (rows, rows on device, start, end)
        self._early_pairs: tuple[tuple[int, int], ...] = ()  # (row, id) blocked now
        self._early: tuple[torch.Tensor, torch.Tensor] | None = None  # the same, on the device

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _mask_spec(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def entry(params: SamplingParams, _: Any, output_ids: list[int]) -> tuple[MaskSpec, list[int]] | None:
            spec = _mask_spec(params)
            return None if spec is None else (spec, output_ids)  # output_ids: live list

        if process_dict_updates(self._specs, batch_update, entry):
            by_range: dict[tuple[int, int], list[int]] = {}
            for row, (spec, _) in sorted(self._specs.items()):
                by_range.setdefault((spec.start, spec.end), []).append(row)
            self._ranges = [
                (rows, self._index(rows), start, end) for (start, end), rows in by_range.items() if end > start
            ]
        pairs = tuple(
            sorted(
                (row, token)
                for row, (spec, output_ids) in self._specs.items()
                if len(output_ids) < spec.min_tokens
                for token in spec.early_ids
            )
        )
        if pairs != self._early_pairs:
            self._early_pairs = pairs
            self._early = (self._index([r for r, _ in pairs]), self._index([t for _, t in pairs])) if pairs else None

    def _index(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self._pin:
            host = host.pin_memory()
        return host.to(self._device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for rows, device_rows, start, end in self._ranges:
            if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # every row: no gather
                logits[:, start:end] = float("-inf")
            else:
                logits[device_rows, start:end] = float("-inf")
        if self._early is not None:
            logits[self._early] = float("-inf")
        return logits


def _mask_spec(params: SamplingParams) -> MaskSpec | None:
    spec = (params.extra_args or {}).get(MASK_KEY)
    if spec is not None and not isinstance(spec, MaskSpec):
        raise ValueError(f"extra_args[{MASK_KEY!r}]: expected a MaskSpec, got {type(spec).__name__}")
    return spec
