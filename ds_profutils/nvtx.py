"""``instrument_w_nvtx``: name a function's calls in Nsight and in torch profiler traces.

DeepSpeed's decorator looks up the accelerator and pushes a range on every call, about 1.5 us on a
CPU even when nothing listens.  Here the question "does anyone listen?" is answered when the answer
can change (an NVTX tool is attached at start; a torch profiler starts or stops recording; a config
or ``enable_nvtx`` is applied) and kept in one module global, so a call with nobody listening costs
one global lookup over a pass-through wrapper.  The wrapper keeps the function's name and doc, and
pops its range also when the call raises.

Module-level names DeepSpeed code touches are kept: ``enable_nvtx`` (assigning it still works),
``DEEPSPEED_NVTX_DOMAIN``, ``is_compiling`` and ``get_accelerator``.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Optional, TypeVar

import deepspeed.utils.nvtx as _ds_nvtx
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.compiler import is_compiling
from torch.autograd.profiler import record_function

__all__ = [
    "DEEPSPEED_NVTX_DOMAIN",
    "enable_nvtx",
    "instrument_w_nvtx",
    "nvtx_range",
    "nvtx_tool_attached",
    "configure_nvtx",
    "set_torch_profiler_recording",
    "ranges_active",
]

F = TypeVar("F", bound=Callable[..., Any])

DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"

enable_nvtx = True
"""DeepSpeed's switch.  Assigning ``ds_profutils.nvtx.enable_nvtx = False`` turns the ranges off."""

_config_enabled = True  # the ds_config "nvtx.enabled" value, applied by configure_nvtx()
_torch_recording = False  # set by ds_profutils' profiler while torch.profiler records
_tool_attached: Optional[bool] = None  # None until first asked; a tool attaches only at process start
_RANGES_ON = False  # the one flag the hot path reads; recomputed by _refresh()


def nvtx_tool_attached() -> bool:
    """True when an NVTX tool (Nsight Systems, ...) is injected into this process.

    NVTX reports a domain as enabled only when a tool is attached, which can happen only at process
    start, so the answer is computed once.
    """
    global _tool_attached
    if _tool_attached is None:
        _tool_attached = _ask_nvtx_for_tool(DEEPSPEED_NVTX_DOMAIN)
    return _tool_attached


def _ask_nvtx_for_tool(domain: str) -> bool:
    try:
        import nvtx
        from nvtx._lib import dummy_domain
    except ImportError:  # nvtx is a dependency, but an odd install must not break training
        return False
    return nvtx.get_domain(domain) is not dummy_domain


def _nvtx_ranges_on() -> bool:
    # DeepSpeed's own switch counts too: engine.compile() clears deepspeed.utils.nvtx.enable_nvtx.
    return enable_nvtx and _ds_nvtx.enable_nvtx and _config_enabled and nvtx_tool_attached()


def _refresh() -> None:
    global _RANGES_ON
    _RANGES_ON = _torch_recording or _nvtx_ranges_on()


def ranges_active() -> bool:
    """Whether a decorated call records a range now.

    Asked afresh, not read from the hot-path flag: DeepSpeed code may have cleared its own
    ``enable_nvtx`` since (``engine.compile()`` does), which ``nvtx_range`` checks on entry.
    """
    return _torch_recording or _nvtx_ranges_on()


def configure_nvtx(enabled: bool = True, domain: str = "DeepSpeed") -> None:
    """Apply the ds_config ``"nvtx"`` section: switch NVTX ranges and choose their domain."""
    global _config_enabled, DEEPSPEED_NVTX_DOMAIN
    _config_enabled = bool(enabled)
    DEEPSPEED_NVTX_DOMAIN = domain
    _refresh()


def set_torch_profiler_recording(recording: bool) -> None:
    """Called by ds_profutils' profiler when torch.profiler starts and stops recording."""
    global _torch_recording
    _torch_recording = bool(recording)
    _refresh()


def _range_push(accelerator: Any, message: str) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_push(message, domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_push(message)


def _range_pop(accelerator: Any) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_pop()


class nvtx_range:
    """Context manager for one named range, in NVTX (when a tool listens) and in the torch trace.

    Entered only when ``ranges_active()``; the caller checks that flag so the idle path stays free.
    """

    __slots__ = ("name", "_accelerator", "_record")

    def __init__(self, name: str) -> None:
        self.name = name
        self._accelerator: Any = None
        self._record: Optional[record_function] = None

    def __enter__(self) -> "nvtx_range":
        if _nvtx_ranges_on():
            self._accelerator = get_accelerator()
            _range_push(self._accelerator, self.name)
        if _torch_recording:
            self._record = record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._record is not None:
                self._record.__exit__(*exc_info)
        finally:
            if self._accelerator is not None:
                _range_pop(self._accelerator)


def instrument_w_nvtx(func: F) -> F:
    """Decorator: each call of ``func`` is a range named ``func.__qualname__`` while anyone listens.

    Skipped under ``torch.compile`` (a range would break the graph), as in DeepSpeed.
    """
    name = func.__qualname__

    @functools.wraps(func)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        if not _RANGES_ON or is_compiling():
            return func(*args, **kwargs)
        with nvtx_range(name):
            return func(*args, **kwargs)

    return wrapped_fn  # type: ignore[return-value]


class _NvtxModule(types.ModuleType):
    """Recompute the hot-path flag when DeepSpeed-style code assigns ``nvtx.enable_nvtx``."""

    def __setattr__(self, attr: str, value: Any) -> None:
        super().__setattr__(attr, value)
        if attr == "enable_nvtx":
            _refresh()


sys.modules[__name__].__class__ = _NvtxModule
_refresh()  # a tool injected at process start must be seen without any further call
