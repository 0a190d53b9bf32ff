"""``instrument_w_nvtx``: name a function's calls in Nsight (through the accelerator) and in torch traces.

As DeepSpeed's decorator, each call is a range pushed through ``get_accelerator().range_push`` /
``range_pop`` -- with ``domain=`` where the accelerator's ``supports_nvtx_domain`` is true, plainly
otherwise -- whenever ``enable_nvtx`` (ours and DeepSpeed's, which ``engine.compile()`` clears)
allows it and torch is not compiling.  While a ds_profutils profiler records, the range is also a
``record_function`` in the torch trace.  The wrapper keeps the function's name and doc, and pops its
range also when the call raises.

The config's ``"nvtx"`` section (:func:`configure_nvtx`) sets both ``enable_nvtx`` switches, so it
governs DeepSpeed's own ~85 instrumented functions as well as ours, and names the domain of both
where the accelerator takes a domain (:func:`domain_not_applicable` says where it does not).

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
import logging
import os
import sys
import types
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import deepspeed.accelerator.real_accelerator as _installed
import deepspeed.utils.nvtx as _ds_nvtx
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.compiler import is_compiling
from torch.autograd.profiler import record_function

from .logging import log_dist, log_dist_once

__all__ = [
    "DEEPSPEED_NVTX_DOMAIN",
    "configure_nvtx",
    "domain_not_applicable",
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
_DEFAULT_DOMAIN = DEEPSPEED_NVTX_DOMAIN

enable_nvtx = True
"""DeepSpeed's switch.  Assigning ``ds_profutils.nvtx.enable_nvtx = False`` turns the ranges off."""

_CUDA_ACCELERATOR_MODULE = "deepspeed.accelerator.cuda_accelerator"
_INJECTION_VARIABLE = "NVTX_INJECTION64_PATH"  # how Nsight Systems injects its NVTX tool into a process
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
    except ImportError:  # the extra ds-profutils[nvtx] is not installed
        log_dist(f"ds_profutils: the nvtx package is not installed (pip install ds-profutils[nvtx]), so an NVTX "
                 f"tool is recognised only by {_INJECTION_VARIABLE}, which Nsight Systems sets; "
                 f"{'one is' if os.environ.get(_INJECTION_VARIABLE) else 'none is'} attached by that sign",
                 ranks=[0],
                 level=logging.WARNING)
        return bool(os.environ.get(_INJECTION_VARIABLE))
    return nvtx.get_domain(domain) is not dummy_domain


def _pushes_allowed() -> bool:
    """DeepSpeed's condition: both ``enable_nvtx`` switches on, and not compiling."""
    return enable_nvtx and _ds_nvtx.enable_nvtx and not is_compiling()


def _range_push_module(accelerator: Any) -> str:
    """The module that defines the accelerator's ``range_push`` (which tells DeepSpeed's own accelerators)."""
    return getattr(getattr(type(accelerator), "range_push", None), "__module__", "") or ""


def domain_not_applicable(accelerator: Any) -> Optional[str]:
    """Why ranges pushed through ``accelerator`` cannot carry a named domain, or None where they can.

    DeepSpeed passes ``domain=`` only where ``supports_nvtx_domain`` is true, and its CUDA accelerator
    uses that domain only when the ``nvtx`` package imports (else it pushes into torch.cuda.nvtx's
    default domain).
    """
    if not getattr(accelerator, "supports_nvtx_domain", False):
        return f"the {type(accelerator).__name__} accelerator takes no NVTX domain"
    module = sys.modules.get(_range_push_module(accelerator))
    if module is not None and module.__name__ == _CUDA_ACCELERATOR_MODULE and getattr(module, "nvtx", None) is None:
        return ("DeepSpeed's CUDA accelerator names a domain only with the nvtx package (pip install "
                "ds-profutils[nvtx]); without it ranges go to torch.cuda.nvtx's default domain")
    return None


def _cannot_be_heard(accelerator: Any) -> bool:
    """True for an accelerator whose ranges reach nobody: CPU's (a no-op), or CUDA's with no NVTX tool."""
    module = _range_push_module(accelerator)
    if module == "deepspeed.accelerator.cpu_accelerator":
        return getattr(type(accelerator), "range_pop", None).__module__ == module
    return module == _CUDA_ACCELERATOR_MODULE and not nvtx_tool_attached()


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


_applied: List[Tuple[object, bool, str]] = []  # configurations in force, latest last: (token, enabled, domain)
_before: List[Any] = []  # both switches and both domains as they were before the first


def _switches_and_domains() -> Tuple[bool, str, bool, str]:
    return enable_nvtx, DEEPSPEED_NVTX_DOMAIN, _ds_nvtx.enable_nvtx, _ds_nvtx.DEEPSPEED_NVTX_DOMAIN


def _set_switches_and_domains(ours_enabled: bool, ours_domain: str, ds_enabled: bool, ds_domain: str) -> None:
    global enable_nvtx, DEEPSPEED_NVTX_DOMAIN
    enable_nvtx, DEEPSPEED_NVTX_DOMAIN = ours_enabled, ours_domain
    _ds_nvtx.enable_nvtx, _ds_nvtx.DEEPSPEED_NVTX_DOMAIN = ds_enabled, ds_domain


def _apply(enabled: bool, domain: str) -> None:
    why_not = domain_not_applicable(get_accelerator())
    if why_not is not None and domain != _DEFAULT_DOMAIN:
        log_dist_once(f"ds_profutils: nvtx.domain {domain!r} does not apply here: {why_not}",
                      ranks=[0],
                      level=logging.WARNING)
    ds_domain = domain if why_not is None else _before[3]
    _set_switches_and_domains(enabled, domain, enabled, ds_domain)


def configure_nvtx(enabled: bool = True, domain: str = _DEFAULT_DOMAIN) -> Callable[[], None]:
    """Apply the ds_config ``"nvtx"`` section to ours and DeepSpeed's ranges; return what undoes it.

    ``enabled`` sets ``enable_nvtx`` here and in ``deepspeed.utils.nvtx`` (which DeepSpeed's own
    ``instrument_w_nvtx`` sites read).  ``domain`` becomes the domain of both where the current
    accelerator takes one; elsewhere a domain other than DeepSpeed's is reported, once, as not
    applicable, and DeepSpeed's is left as it was.

    The returned callable takes this configuration out: the latest one still in force applies
    again, or, after the last, both switches and both domains are put back as they were before the
    first.  Several engines may each configure and undo in any order.
    """
    if not _applied:
        _before[:] = _switches_and_domains()
    token = object()
    _applied.append((token, bool(enabled), domain))
    _apply(bool(enabled), domain)

    def undo() -> None:
        entries = [entry for entry in _applied if entry[0] is token]
        if not entries:
            return
        _applied.remove(entries[0])
        if _applied:
            _apply(*_applied[-1][1:])
        else:
            _set_switches_and_domains(*_before)

    return undo


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
