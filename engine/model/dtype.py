"""The dtype a model computes in and keeps its KV in: bf16 where the machine computes it natively, else fp32.

bf16 halves every byte the engine reads per token (weights, KV pages, window rings) and every byte the store
keeps and moves (blocks, continuation and window records are written at the KV's width); a CPU with
AVX512-BF16 or AMX multiplies it natively, about twice the fp32 rate (docs/performance.md). fp32 stays the
reference the fidelity tests hold bf16 to. The store's namespace includes the dtype, so engines of different
dtypes never read each other's blocks.
"""

from __future__ import annotations

from functools import cache

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
AUTO = "auto"
CHOICES = (AUTO, *DTYPES)


def check_name(name: str, owner: str) -> None:
    """A config's dtype setting, refused with its owner's name before any model loads."""
    if name not in CHOICES:
        raise ValueError(f"{owner}: dtype must be one of {', '.join(CHOICES)}, got {name!r}")


def resolve(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto` (bf16 where `device` computes it natively, else fp32), `bfloat16` or `float32` as a dtype; a dtype
    is taken as it is."""
    if isinstance(name, torch.dtype):
        if name not in NAMES:
            raise ValueError(f"the engine computes in {' or '.join(DTYPES)}, not {name}")
        return name
    if name == AUTO:
        return torch.bfloat16 if native_bf16(torch.device(device)) else torch.float32
    check_name(name, "the engine")
    return DTYPES[name]


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA device that says so, a CPU whose flags name a bf16
    instruction set (x86 AVX512-BF16 or AMX-BF16, Arm BF16)."""
    if device.type == "cuda":  # Ampere or later: not an emulation
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and bool(_cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"}) \
        and torch.backends.mkldnn.is_available()


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
