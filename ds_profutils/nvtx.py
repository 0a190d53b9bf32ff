"""``instrument_w_nvtx``: name a function's calls in Nsight (through the accelerator) and in torch traces.

As DeepSpeed's decorator, each call is a range pushed through ``get_accelerator().range_push`` /
``range_pop`` -- with ``domain=`` where the accelerator's ``supports_nvtx_domain`` is true, plainly
otherwise -- whenever ``enable_nvtx`` (ours and DeepSpeed's, which ``engine.compile()`` clears) and
the config's ``"nvtx"`` section allow it and torch is not compiling.  While a ds_profutils profiler
records, the range is also a ``record_function`` in the torch trace.  The wrapper keeps the
function's name and doc, and pops its range also when the call raises.

DeepSpeed's decorator costs about 1.5 us per call even when nothing listens.  Here an accelerator
whose ranges cannot reach anyone -- the CPU accelerator (its ``range_push`` does nothing), or CUDA
with no NVTX tool attached (NVTX drops ranges then) -- is remembered as idle, and a call costs one
identity test against the installed accelerator.  Any other accelerator (MLU, out-of-tree, one set
with ``deepspeed.accelerator.set_accelerator``) is always called, as DeepSpeed would.

Module-level names DeepSpeed code touches are kept: ``enable_nvtx``, ``DEEPSPEED_NVTX_DOMAIN``,
``is_compiling`` and ``get_accelerator``; assigning any of them takes effect on the next call.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Optional, TypeVar

import deepspeed.accelerator.real_accelerator as _installed
import deepspeed.utils.nvtx as _ds_nvtx
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.compiler import is_compiling
from torch.autograd.profiler import record_function

__all__ = [
    "DEEPSPEED_NVTX_DOMAIN",
    "configure_nvtx",
    "enable_nvtx",
    "instrument_w_nvtx",
    "nvtx_range",
    "nvtx_tool_attached",
    "range_pop",
    "range_push",
    "ranges_active",
    "set_torch_profiler_recording",
]

F = TypeVar("F", bound=Callable[..., Any])

DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"

enable_nvtx = True
"""DeepSpeed's switch.  Assigning ``ds_profutils.nvtx.enable_nvtx = False`` turns the ranges off."""

_config_enabled = True  # the ds_config "nvtx.enabled" value, applied by configure_nvtx()
_torch_recording = False  # set by ds_profutils' profiler while torch.profiler records
_tool_attached: Optional[bool] = None  # None until first asked; a tool attaches only at process start
_NOBODY = object()  # an accelerator that is never installed
_idle_accelerator: Any = _NOBODY  # the installed accelerator, while no call can reach a listener
_refreshed_for: Any = _NOBODY  # the installed accelerator when idleness was last decided


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


def _pushes_allowed() -> bool:
    """DeepSpeed's condition (both ``enable_nvtx`` switches, not compiling) and the config's switch."""
    return enable_nvtx and _ds_nvtx.enable_nvtx and _config_enabled and not is_compiling()


def _cannot_be_heard(accelerator: Any) -> bool:
    """True for an accelerator whose ranges reach nobody: CPU's (a no-op), or CUDA's with no NVTX tool."""
    push = getattr(type(accelerator), "range_push", None)
    module = getattr(push, "__module__", "")
    if module == "deepspeed.accelerator.cpu_accelerator":
        return getattr(type(accelerator), "range_pop", None).__module__ == module
    return module == "deepspeed.accelerator.cuda_accelerator" and not nvtx_tool_attached()


def _refresh() -> None:
    """Decide again whether the installed accelerator is idle (called whenever an input may change)."""
    global _idle_accelerator, _refreshed_for
    accelerator = _refreshed_for = _installed.ds_accelerator
    idle = (accelerator is not None and get_accelerator() is accelerator and not _torch_recording
            and _cannot_be_heard(accelerator))
    _idle_accelerator = accelerator if idle else _NOBODY


def ranges_active() -> bool:
    """Whether a decorated call records a range now (in the accelerator or in a torch trace)."""
    return _torch_recording or (_pushes_allowed() and not _cannot_be_heard(get_accelerator()))


def configure_nvtx(enabled: bool = True, domain: str = "DeepSpeed") -> None:
    """Apply the ds_config ``"nvtx"`` section: switch the ranges and choose their domain."""
    global _config_enabled, DEEPSPEED_NVTX_DOMAIN
    _config_enabled = bool(enabled)
    DEEPSPEED_NVTX_DOMAIN = domain
    _refresh()


def set_torch_profiler_recording(recording: bool) -> None:
    """Called by ds_profutils' profiler when torch.profiler starts and stops recording."""
    global _torch_recording
    _torch_recording = bool(recording)
    _refresh()


def range_push(accelerator: Any, message: str) -> None:
    """Push a range as DeepSpeed does: in our domain where the accelerator takes one."""
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_push(message, domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_push(message)


def range_pop(accelerator: Any) -> None:
    """Pop the range ``range_push`` pushed."""
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_pop()


class nvtx_range:
    """Context manager for one named range: in the accelerator (as DeepSpeed pushes) and in the torch trace."""

    __slots__ = ("name", "_accelerator", "_record")

    def __init__(self, name: str) -> None:
        self.name = name
        self._accelerator: Any = None
        self._record: Optional[record_function] = None

    def __enter__(self) -> "nvtx_range":
        if _pushes_allowed():
            self._accelerator = get_accelerator()
            range_push(self._accelerator, self.name)
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
                range_pop(self._accelerator)


def instrument_w_nvtx(func: F) -> F:
    """Decorator: each call of ``func`` is a range named ``func.__qualname__`` (see the module doc)."""
    name = func.__qualname__

    @functools.wraps(func)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        if _idle_accelerator is _installed.ds_accelerator:
            return func(*args, **kwargs)
        if _installed.ds_accelerator is not _refreshed_for:  # installed or replaced since last decided
            _refresh()
            if _idle_accelerator is _installed.ds_accelerator:
                return func(*args, **kwargs)
        with nvtx_range(name):
            return func(*args, **kwargs)

    return wrapped_fn  # type: ignore[return-value]


class _NvtxModule(types.ModuleType):
    """Decide idleness again when code assigns ``enable_nvtx``, ``get_accelerator`` or ``is_compiling`` here."""

    def __setattr__(self, attr: str, value: Any) -> None:
        super().__setattr__(attr, value)
        if attr in ("enable_nvtx", "get_accelerator", "is_compiling"):
            _refresh()


sys.modules[__name__].__class__ = _NvtxModule
_refresh()
