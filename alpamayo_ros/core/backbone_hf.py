"""Reference backbone on transformers' Qwen3VLForConditionalGeneration, with our own decode loop.

Upstream calls `generate()` with a logits processor and a stopping criterion and reads the
cache it leaves behind. We run the same steps by hand (forward + DynamicCache), which lets a
request bring its own torch.Generator (generate() only uses the global RNG), skips the vision
tower for all but one row, and makes the stop rule explicit:

* logits in fp32; `<i*>` ids masked to -inf; then temperature and top-p (as HF's warpers),
  or argmax when temperature <= 0;
* a row that samples `<|im_end|>` is finished and is fed pad tokens from then on;
* the loop stops one step after every row has produced `<|traj_future_start|>` (the extra
  token, never fed, is why the cache holds every generated token but the last), when every
  row is finished, or at max_new_tokens.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Sequence

import torch

from .backbone import PrefixCache, PromptInputs, Rollout, check_sampling_args, cut_after_stop, forced_row
from .config import AlpamayoConfig
from .tokenizer import AlpamayoTokenizer
from .types import PlanCancelled

def sample_next(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick one token per row from fp32 logits (N, V), the way HF's sampling warpers do."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits / temperature
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


class HFBackbone:
    """Backbone protocol implementation on a loaded transformers Qwen3-VL (see module doc)."""

    name = "hf"
    #: set by the Pipeline: decoding stops (PlanCancelled) between steps once it is set
    stop: threading.Event | None = None

    def __init__(self, model, tokenizer: AlpamayoTokenizer, config: AlpamayoConfig) -> None:
        if model.lm_head.out_features != config.vocab_size or len(tokenizer) != config.vocab_size:
            raise ValueError(
                f"model: lm_head has {model.lm_head.out_features} rows and the tokenizer {len(tokenizer)} ids, "
                f"config vocab_size is {config.vocab_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        ids = tokenizer.ids
        self._masked = (ids.traj_start, ids.traj_start + ids.traj_vocab_size)  # [start, end) of <i*>
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x); use whichever
        # this release has, so the deprecation shim does not warn on every decode step.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def pixel_device(self) -> torch.device:
        return self.device

    @torch.inference_mode()
    def rollout(
        self,
        prompt: PromptInputs,
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        forced_ids: Sequence[int] | None = None,
        min_new_tokens: int = 0,
    ) -> Rollout:
        """Generate reasoning for num_samples rows; see the module doc for the rules.

        forced_ids, if given, is every row's complete generated sequence (teacher forcing):
        nothing is sampled, and all but its last token are fed, as in a real rollout.
        """
        check_sampling_args(num_samples, temperature, top_p, max_new_tokens, min_new_tokens)
        prompt_len = int(prompt.input_ids.shape[0])
        timings: dict[str, float] = {}
        if forced_ids is not None:
            forced = forced_row(forced_ids)
            cache, _ = self._prefill_prompt(prompt, num_samples)
            generated = torch.tensor([forced] * num_samples, dtype=torch.long, device=self.device)
            if len(forced) > 1:
                self._step(generated[:, :-1], cache, prompt_len, prompt.rope_delta)
        else:
            cache, generated = self._decode(
                prompt, num_samples, temperature, top_p, max_new_tokens, generator, min_new_tokens, timings
            )
        rows = [cut_after_stop(row, self.tokenizer.ids.traj_future_start) for row in generated.tolist()]
        start = self._clock()
        prefix = self._prefix_cache(cache, prompt_len, prompt.rope_delta, generated)
        timings["kv_handoff"] = self._clock() - start
        return Rollout(generated_ids=rows, cache=prefix, timings_ms=timings)

    def _clock(self) -> float:
        """Milliseconds, after the device finished its queued work (stage timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() * 1e3

    def _decode(
        self,
        prompt: PromptInputs,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        min_new_tokens: int,
        timings: dict[str, float],
    ):
        """Upstream's masked sampling loop with its stop rule; returns (cache, tokens (N, steps)).

        Before min_new_tokens, the stop and end tokens are masked too (fixed-length benchmarks).
        Fills timings["prefill"] (vision + prompt) and timings["decode"].
        """
        ids = self.tokenizer.ids
        start = self._clock()
        cache, logits = self._prefill_prompt(prompt, num_samples)
        prefilled = self._clock()
        timings["prefill"] = prefilled - start
        prompt_len = int(prompt.input_ids.shape[0])
        tokens: list[torch.Tensor] = []
        finished = torch.zeros(num_samples, dtype=torch.bool, device=self.device)
        found_stop = torch.zeros_like(finished)
        for step in range(max_new_tokens):
            self._check_stop()
            logits[:, self._masked[0] : self._masked[1]] = float("-inf")
            if step < min_new_tokens:
                logits[:, [ids.traj_future_start, ids.im_end]] = float("-inf")
            token = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)
            token = torch.where(finished, ids.pad, token)
            tokens.append(token)
            stop_now = bool(found_stop.all())  # every row had produced it before this token
            found_stop |= token == ids.traj_future_start
            finished |= token == ids.im_end
            if stop_now or bool(finished.all()) or step + 1 == max_new_tokens:
                break
            logits = self._step(token[:, None], cache, prompt_len + step, prompt.rope_delta)
        timings["decode"] = self._clock() - prefilled
        return cache, torch.stack(tokens, dim=1)

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise PlanCancelled("decoding cancelled: the pipeline is stopping")

    @torch.inference_mode()
    def prefill(self, prompt: PromptInputs, generated_ids: Sequence[Sequence[int]]) -> PrefixCache:
        """K/V of prompt + each row's generated tokens (rows right-padded with pad tokens).

        The prompt (and the vision tower) runs once; its cache is repeated per row, then all
        rows' tokens go through in one forward, as upstream builds its route-free CFG cache.
        """
        if not generated_ids or not all(generated_ids):
            raise ValueError("generated_ids: need at least one row, each with at least one token")
        rows = len(generated_ids)
        cache, _ = self._prefill_prompt(prompt, rows)
        width = max(len(row) for row in generated_ids)
        pad = self.tokenizer.ids.pad
        padded = torch.tensor(
            [list(row) + [pad] * (width - len(row)) for row in generated_ids], dtype=torch.long, device=self.device
        )
        prompt_len = int(prompt.input_ids.shape[0])
        self._step(padded, cache, prompt_len, prompt.rope_delta)
        lengths = torch.tensor([len(row) for row in generated_ids], device=self.device)
        return self._prefix_cache(cache, prompt_len, prompt.rope_delta, padded, lengths)

    @torch.inference_mode()
    def generate(
        self,
        prompt: PromptInputs,
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
    ) -> list[list[int]]:
        """Sample plain text for VQA (upstream's generate_text).

        No `<i*>` mask and no trajectory stop rule; a row ends at `<|im_end|>` (kept in its ids).
        """
        check_sampling_args(num_samples, temperature, top_p, max_new_tokens)
        ids = self.tokenizer.ids
        cache, logits = self._prefill_prompt(prompt, num_samples)
        prompt_len = int(prompt.input_ids.shape[0])
        tokens: list[torch.Tensor] = []
        finished = torch.zeros(num_samples, dtype=torch.bool, device=self.device)
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)
            tokens.append(torch.where(finished, ids.pad, token))
            finished |= tokens[-1] == ids.im_end
            if bool(finished.all()) or step + 1 == max_new_tokens:
                break
            logits = self._step(tokens[-1][:, None], cache, prompt_len + step, prompt.rope_delta)
        rows = torch.stack(tokens, dim=1).tolist()
        return [row[: row.index(ids.im_end) + 1] if ids.im_end in row else row for row in rows]

    def _prefill_prompt(self, prompt: PromptInputs, rows: int):
        """Run the prompt once (one row) and repeat its cache and last logits to `rows` rows."""
        from transformers import DynamicCache

        cache = DynamicCache()
        outputs = self.model(
            input_ids=prompt.input_ids[None].to(self.device),
            position_ids=prompt.position_ids[:, None].to(self.device),
            # patches made here, on the device and in the dtype of the vision tower
            pixel_values=prompt.images.patches(self.device, self.model.model.visual.dtype),
            image_grid_thw=prompt.images.image_grid_thw.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        cache.batch_repeat_interleave(rows)
        return cache, outputs.logits[:, -1].float().repeat(rows, 1)

    def _step(self, tokens: torch.Tensor, cache, start: int, rope_delta: int) -> torch.Tensor:
        """Feed tokens (N, L) at sequence index start.. into the cache; fp32 logits of the last."""
        rows, length = tokens.shape
        positions = torch.arange(start, start + length, device=self.device) + rope_delta
        outputs = self.model(
            input_ids=tokens,
            position_ids=positions.expand(3, rows, length),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return outputs.logits[:, -1].float()

    def _prefix_cache(
        self,
        cache,
        prompt_len: int,
        rope_delta: int,
        generated: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> PrefixCache:
        """Wrap the DynamicCache; offset = just after the first <|traj_future_start|>.

        A row without it gets offset prompt + its length (upstream: last index + 1), so
        only its own tokens are attended.
        """
        rows, width = generated.shape
        lengths = torch.full((rows,), width, device=self.device) if lengths is None else lengths
        is_stop = generated == self.tokenizer.ids.traj_future_start
        first = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1) + 1, lengths)
        layers = cache.layers
        return PrefixCache(
            keys=[layer.keys for layer in layers],
            values=[layer.values for layer in layers],
            offsets=(first + prompt_len).to(torch.long),
            rope_deltas=torch.full((rows,), rope_delta, dtype=torch.long, device=self.device),
        )
