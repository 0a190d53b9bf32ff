"""Model FLOPs of one micro step (a forward and its backward), counted once per input shape and reused.

The FLOPs of a model's forward and backward depend on the shapes of its inputs, not on their values,
so torch's :class:`~torch.utils.flop_counter.FlopCounterMode` is switched on for exactly one micro
step of each new input shape and the count is kept.  A micro step of a known shape costs building a
key from its input shapes and one dict lookup; the counting mode is off.  Counting costs a few
times a plain micro step (every operator passes through the mode's Python dispatch), once per shape.

:class:`FlopCounter` is driven by the hooks the engine's hub puts on an engine (none of its own):

* :meth:`~FlopCounter.forward_started` from a forward pre-hook of the engine's module registered
  with ``with_kwargs=True`` and ahead of DeepSpeed's own (``prepend=True``): the counting mode, when
  a shape is new, takes in the whole forward.  ZeRO-3's parameter gathers in DeepSpeed's hooks run
  inside it and count no FLOPs (they move data).
* :meth:`~FlopCounter.forward_ended` from the module's forward hook, with the forward's output.
* :meth:`~FlopCounter.backward_ended` when ``engine.backward()`` returns, and again when
  ``engine.step()`` starts (a no-op after ``engine.backward()``; after a torch-style backward it
  switches the counting mode off before the optimizer step rather than at the next forward).
* :meth:`~FlopCounter.figures` when the micro step's record closes (at ``backward_ended``, at the
  end of ``engine.step()``, at an eval forward's end), before the next ``forward_started``.
* :meth:`~FlopCounter.discard` when an error leaves the forward, backward or step, and at detach.

How the end of a backward is seen: a backward need not go through ``engine.backward()``
(DeepSpeed 0.19 takes a torch-style ``engine.scale(loss).backward()``, and a user's loss may sit
outside the module).  So at a counted forward's end a gradient hook goes on the forward's outputs;
when the backward reaches them it queues an autograd-engine callback, which runs when that whole
backward is done and reads the count there -- whichever call started the backward.  The mode is
left on the training thread only (``backward_ended``, else the next ``forward_started``): the
callback may run on an autograd device thread, whose thread-local mode stack is not the training
thread's.  Operators between the backward's end and that moment are no longer in the figure.

A forward without a backward to follow -- under ``torch.no_grad()`` or with no output that needs a
gradient -- is a micro step of its own, forward FLOPs only (``MicroStepFlops.backward`` False).  The
key holds whether gradients were enabled and the module's training flag beside the input shapes, so
an eval forward and a train forward of one shape are two entries.  A train forward whose backward
never came before the next forward (two forwards, one backward) is not kept; it is counted again
next time, within the attempts' bound below.

Jobs whose input shapes change every step (batches padded to their longest sequence) would count
all the time: at most ``max_counted_shapes`` distinct shapes are counted exactly (and at most twice
that many counting attempts are made); beyond that a shape's FLOPs are scaled linearly from the
counted shape of the same kind (gradients, training flag) with the nearest token count (sample count
where there are no tokens), ``flops_source`` ``"scaled"`` rather than ``"counted"``, said once in a
log line.  Linear scaling is exact for the dense layers and underestimates attention, whose FLOPs
grow with the square of the sequence length.

With activation checkpointing the forward recomputed in the backward is counted too: the figure is
what the hardware computed (as FlopCounterMode over the same micro step says), above the model FLOPs
of PaLM's MFU definition by about one forward.

Tokens and samples of a micro step, where its inputs show them: the token tensor is the keyword
argument ``input_ids`` when it is a tensor, else the first positional argument that is an integer
tensor (not bool); ``tokens`` is its element count (padding included, as the FLOPs count it) and
``samples`` its first dimension.  Without a token tensor, ``samples`` is the first dimension of the
first tensor argument (positional first, then keyword: a float feature batch gives samples only),
and ``tokens`` is None.  Only tensors enter the shape key: a keyword flag that changes the model's
work (``use_cache``) is not seen.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode

from ...logging import logger
from ..hooks import on_backward_end

__all__ = ["DEFAULT_MAX_COUNTED_SHAPES", "FlopCounter", "MicroStepFlops", "inspect_batch"]

DEFAULT_MAX_COUNTED_SHAPES = 8
"""Distinct input shapes counted exactly before later ones are scaled."""
_SCALED_KEPT = 4096
"""Scaled figures remembered (beyond it each is scaled again: a scan of ``max_counted_shapes`` entries)."""


class MicroStepFlops(NamedTuple):
    """What one micro step did: its model FLOPs and the batch it took."""

    flops: Optional[int]
    """Forward (and, with ``backward``, backward) FLOPs; None when unknown (no count to scale from)."""
    flops_source: Optional[str]
    """``"counted"`` (FlopCounterMode counted this shape), ``"scaled"`` (from the nearest counted shape)."""
    backward: bool
    """Whether ``flops`` includes a backward."""
    tokens: Optional[int]
    samples: Optional[int]


class _Count(NamedTuple):
    flops: int
    backward: bool
    size: Optional[int]  # tokens, else samples, of the counted batch: what scaling divides by
    source: str


class _MicroStep:
    """The micro step in progress: its key and batch, and its count once known."""

    __slots__ = ("key", "tokens", "samples", "grad", "count", "counting", "forward_flops", "backward_reached")

    def __init__(self, key: tuple, tokens: Optional[int], samples: Optional[int], grad: bool) -> None:
        self.key = key
        self.tokens = tokens
        self.samples = samples
        self.grad = grad
        self.count: Optional[_Count] = None
        self.counting = False
        self.forward_flops: Optional[int] = None
        self.backward_reached = False  # a backward reached this forward's outputs

    @property
    def size(self) -> Optional[int]:
        return self.tokens if self.tokens is not None else self.samples


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                             torch.uint64})
"""The dtypes of a token tensor (token ids, not bool masks)."""


def inspect_batch(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[tuple, Optional[int], Optional[int]]:
    """The shape key of a forward's inputs, and its tokens and samples by the module doc's rule.

    Each tensor's ``shape`` is read once (building a ``torch.Size`` is most of the cost of a known step).
    """
    shapes: List[Any] = []
    tokens = first = None
    for value in args:
        if isinstance(value, torch.Tensor):
            shape = value.shape
            shapes.append(shape)
            if first is None:
                first = shape
            if tokens is None and value.dtype in _INTEGER_DTYPES:
                tokens = shape
        else:
            shapes.append(None)  # keeps positions apart: (None, x) is not (x, None)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            shape = value.shape
            shapes.append((name, shape))
            if first is None:
                first = shape
            if name == "input_ids":
                tokens = shape  # named, so it wins over a positional integer tensor
    if tokens is not None:
        return tuple(shapes), math.prod(tokens), (tokens[0] if tokens else 1)
    return tuple(shapes), None, (None if first is None else first[0] if first else 1)


class FlopCounter:
    """Counts each new input shape's micro step with FlopCounterMode, then reuses the count (module doc)."""

    def __init__(self, max_counted_shapes: int = DEFAULT_MAX_COUNTED_SHAPES) -> None:
        if type(max_counted_shapes) is not int or max_counted_shapes < 1:
            raise ValueError(f"max_counted_shapes must be an integer >= 1, got {max_counted_shapes!r}")
        self.max_counted_shapes = max_counted_shapes
        self.counting_attempts = 0
        """Micro steps run under the counting mode so far (each costs the mode's dispatch)."""
        self._known: Dict[tuple, _Count] = {}
        self._counted: List[Tuple[tuple, _Count]] = []
        self._current: Optional[_MicroStep] = None
        self._mode: Optional[FlopCounterMode] = None
        self._mode_thread: Optional[int] = None  # the thread the counting mode was entered on
        self._hook: Optional[Any] = None
        self._scaling_said = False

    @property
    def counting(self) -> bool:
        """Whether the counting mode is on now."""
        return self._mode is not None

    @property
    def counted_shapes(self) -> int:
        """Distinct input shapes counted exactly so far."""
        return len(self._counted)

    # ---- the engine's moments ---------------------------------------------------------------------------

    def forward_started(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """A forward of ``module`` starts: look its shape up, or count it, or scale it."""
        if self._mode is not None:
            self._leave()  # the last count's backward ended elsewhere (torch-style), or never came
        shapes, tokens, samples = inspect_batch(args, kwargs)
        grad = torch.is_grad_enabled()
        micro = self._current = _MicroStep((grad, module.training, shapes), tokens, samples, grad)
        micro.count = self._known.get(micro.key)
        if micro.count is not None:
            return
        if (self._mode is None and len(self._counted) < self.max_counted_shapes
                and self.counting_attempts < 2 * self.max_counted_shapes):
            self._enter()
            micro.counting = True
        else:
            micro.count = self._scaled(micro)

    def forward_ended(self, output: Any) -> None:
        """The forward returned ``output``: a forward with no backward to follow is counted now; otherwise
        the backward's end is watched from the outputs' gradients (module doc)."""
        micro = self._current
        if micro is None or not micro.counting or micro.forward_flops is not None or self._mode is None:
            return
        micro.forward_flops = self._mode.get_total_flops()
        if micro.grad:
            self._hook = on_backward_end(output, functools.partial(self._backward_reached, micro),
                                         functools.partial(self._backward_done, micro))
        if self._hook is None:
            self._keep(micro, micro.forward_flops, backward=False)
            self._leave()

    def backward_ended(self) -> None:
        """``engine.backward()`` returned (or ``engine.step()`` starts): the count is complete, if the
        autograd callback has not already taken it, and the counting mode goes off.  A count whose
        forward no backward reached is dropped (counted again next time)."""
        micro = self._current
        if self._mode is None:
            return
        if micro is not None and micro.counting and micro.count is None and micro.backward_reached:
            self._keep(micro, self._mode.get_total_flops(), backward=True)
        self._leave()

    def figures(self) -> Optional[MicroStepFlops]:
        """The current micro step's figures (None before any forward); ``flops`` None while its count is
        not complete or when there was nothing to scale from."""
        micro = self._current
        if micro is None:
            return None
        count = micro.count
        if count is None:
            return MicroStepFlops(None, None, False, micro.tokens, micro.samples)
        return MicroStepFlops(count.flops, count.source, count.backward, micro.tokens, micro.samples)

    def discard(self) -> None:
        """Forget the micro step in progress and leave the counting mode (an error left the engine's
        forward, backward or step; or the hub detaches).  Counts kept so far stay."""
        self._current = None
        if self._mode is not None:
            self._leave()

    # ---- counting ---------------------------------------------------------------------------------------

    def _enter(self) -> None:
        self.counting_attempts += 1
        mode = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode
        self._mode_thread = threading.get_ident()  # dispatch modes are per thread: left on this one only

    def _leave(self) -> None:
        """Switch the counting mode off on the training thread, if it is the innermost dispatch mode.

        A mode entered after ours and still on (a program's own FlopCounterMode around a torch-style
        backward) would be popped in our place: then ours stays on until a later moment finds it on top.
        """
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        mode = self._mode
        if mode is None or threading.get_ident() != self._mode_thread or _get_current_dispatch_mode() is not mode.mode:
            return  # an autograd device thread sees a copy of the training thread's modes: not ours to pop
        self._mode = None
        mode.__exit__(None, None, None)

    def _backward_reached(self, micro: _MicroStep) -> None:
        """The backward reached the counted forward's outputs (maybe on an autograd device thread)."""
        micro.backward_reached = True

    def _backward_done(self, micro: _MicroStep) -> None:
        """The whole backward is done: keep the count (the mode leaves later, on the training thread)."""
        mode = self._mode
        if micro is self._current and micro.count is None and mode is not None:
            self._keep(micro, mode.get_total_flops(), backward=True)

    def _keep(self, micro: _MicroStep, flops: int, backward: bool) -> None:
        count = _Count(flops, backward, micro.size, "counted")
        micro.count = count
        self._known[micro.key] = count
        self._counted.append((micro.key, count))

    def _scaled(self, micro: _MicroStep) -> Optional[_Count]:
        """The count of the nearest counted shape of the same kind, scaled by tokens (or samples)."""
        size = micro.size
        kind = micro.key[:2]
        candidates = [count for key, count in self._counted if key[:2] == kind and count.size]
        if size is None or not candidates:
            return None
        nearest = min(candidates, key=lambda count: abs(count.size - size))
        count = _Count(round(nearest.flops * size / nearest.size), nearest.backward, size, "scaled")
        if len(self._known) < _SCALED_KEPT:
            self._known[micro.key] = count
        if not self._scaling_said:
            self._scaling_said = True
            logger.info("ds_profutils: %d input shapes counted exactly; the FLOPs of further shapes are scaled "
                        "from the counted shape with the nearest token (or sample) count (flops_source "
                        "\"scaled\": exact for dense layers, low for attention on longer sequences)",
                        len(self._counted))
        return count
