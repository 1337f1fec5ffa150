"""Import-time stand-ins that let SGLang's host-memory and storage modules import on a CPU-only machine.

Used by the SGLang tests alone, never by the plug-in. SGLang imports `triton` at module level
(`sglang.srt.utils.common`, a 1 GB GPU compiler with no CPU wheel), and `torchvision.transforms` from its
multimodal helpers (PyPI's torchvision is a CUDA build that does not load beside CPU torch). Neither runs
in the code under test: the stand-ins only have to be importable. Any attribute of a stand-in is another
stand-in that can be called, subscripted and used as a decorator.
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
