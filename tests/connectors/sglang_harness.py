"""Import-time stand-ins that let SGLang's host-memory and storage modules import on a CPU-only machine,
and SGLang's host KV pool built on CPU.

Used by the SGLang tests (and bench/connector_paths/sglang.py) alone, never by the plug-in. SGLang
imports `triton` at module level (`sglang.srt.utils.common`, a 1 GB GPU compiler with no CPU wheel), and
`torchvision.transforms` from its multimodal helpers (PyPI's torchvision is a CUDA build that does not
load beside CPU torch). Neither runs in the code under test: the stand-ins only have to be importable.
Any attribute of a stand-in is another stand-in that can be called, subscripted and used as a decorator;
one named like a class is an empty class.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("triton", "torchvision")


class _Anything(types.ModuleType):
    __path__: list[str] = []  # a package, so `import triton.language` works
    __version__ = "3.0.0"

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name.lstrip("_")[:1].isupper():  # a class (torch checks isinstance(x, triton...JITFunction))
            value = _StandInClass(name, (), {"__init__": lambda self, *args, **kwargs: None})
        else:
            value = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a decorator: @triton.jit
        return self

    def __getitem__(self, item):
        return self

    def __mro_entries__(self, bases):
        return (object,)  # a base class: class X(triton.runtime.KernelInterface)


class _StandInClass(type):
    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{cls.__name__}.{name}")  # InterpolationMode.BILINEAR


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Anything(spec.name)

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Make the stand-ins importable (once)."""
    if not any(isinstance(finder, _StandIns) for finder in sys.meta_path):
        sys.meta_path.append(_StandIns())  # last: a real triton or torchvision, where installed, wins


def mha_host_pool(layout: str, layers: int, heads: int, head_dim: int, page: int, device_tokens: int,
                  label: str = "kv"):
    """SGLang's host KV pool (`MHATokenToKVPoolHost`, bfloat16) on CPU, twice the size of a 'device' pool
    of `device_tokens` tokens of CPU buffers, which only lend it their geometry. Call install() first."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    pointers = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
                                pool_label=label)
