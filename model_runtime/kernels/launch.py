"""One Triton kernel source, compiled for CUDA or run by Triton's interpreter on CPU tensors.

Kernels are written as plain functions and wrapped in ``Kernel``; the first launch decorates
them with ``triton.jit``. In a process without CUDA that decoration yields Triton's interpreter
(``TRITON_INTERPRET=1``, set by this package before Triton is first imported): the same source runs with
NumPy, one program at a time, so CI checks the kernels' indexing, masking and arithmetic without
a GPU (slowly: tests keep shapes small). Triton reads that switch when it decorates its own
library functions at import, so it is a per-process choice, and a process that imported Triton
before this module cannot interpret: that is reported rather than failing inside a kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch


def triton_available() -> bool:
    """Triton can be imported (it ships with CUDA builds of torch; CPU builds lack it)."""
    return importlib.util.find_spec("triton") is not None


def _triton() -> Any:
    import triton
    from triton import knobs

    if not torch.cuda.is_available() and not knobs.runtime.interpret:
        raise RuntimeError(
            "Triton kernels on CPU run only under Triton's interpreter, and Triton was imported "
            "before TRITON_INTERPRET=1 was set; set it in the environment"
        )
    return triton


class Kernel:
    """A Triton kernel function, decorated on first launch."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def on(self, device_type: str) -> Any:
        """The launchable kernel (``kernel[grid](*args)``) for tensors on ``device_type``."""
        if self._jitted is None:
            self._jitted = _triton().jit(self.fn)
        interpreted = not torch.cuda.is_available()
        if device_type != ("cpu" if interpreted else "cuda"):
            mode = "interpreted" if interpreted else "compiled for CUDA"
            raise ValueError(f"Triton kernels are {mode} in this process; got {device_type} tensors")
        return self._jitted


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
