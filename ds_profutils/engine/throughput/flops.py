"""Model FLOPs of one micro step, counted once per input-shape signature and reused.

The FLOPs of a model's forward and backward depend on the shapes of its inputs, not on their values,
so one micro step of each new signature is counted (torch's FlopCounterMode formulas, :mod:`.counting`)
and the count is kept.  A micro step of a known signature costs building a key from its input shapes
and one dict lookup.  Counting costs a few times a plain micro step (every operator of the counted
forwards and backward passes through the counting mode's Python dispatch), once per signature.

**The counting window** of a micro step runs from its first forward (its signature: that forward's input
shapes, whether gradients are enabled and the module's training flag) to the end of its backward, and
holds every forward of the engine's module in it and the backward of their outputs -- two forwards
and one backward (siamese models, R-Drop) are one window, counted as FlopCounterMode counts them.  A
forward whose outputs the backward never reached (a train-mode forward whose loss was dropped) is
left out of it.  The window's total is the micro step's ``flops``.  The counting mode is pushed only
inside the engine module's forwards and inside each backward node (:mod:`.counting`), never over the
program's code between them: an error there -- an OOM between forward and backward -- leaves no mode
on any thread, and neither does an engine dropped without ``close()``.  Work of the program between
forward and backward (its loss code, a teacher model's forward) is not the model's and is not counted.

**Model and hardware FLOPs.**  ``flops`` are model FLOPs (PaLM's MFU numerator): a forward recomputed
by activation checkpointing is left out of it and counted in ``hardware_flops`` (``flops`` plus the
recompute: the HFU numerator), so a checkpointed model and its plain twin have the same ``flops``.

**Operators without a formula** -- an attention custom op (flash-attn), CPU SDPA, any custom op -- are
named in ``uncounted_ops`` of the counted micro step (once per signature) and once per name in the
job's log; for attention an analytic term from the model's config (heads, head dim) and the input's
sequence length is added (``analytic_flops`` says how much), so a flash-attention model's MFU is not
understated.

:class:`FlopCounter` is driven by the hooks the engine's hub puts on an engine:

* :meth:`~FlopCounter.forward_started` from a forward pre-hook of the engine's module registered
  with ``with_kwargs=True`` and ahead of DeepSpeed's own (``prepend=True``): the counting mode, when
  a signature is new, takes in the whole forward (ZeRO-3's gathers in DeepSpeed's hooks count no FLOPs);
  it is popped by :meth:`~FlopCounter.forward_left`, told from the hub's ``always_call`` forward hook at the end
  of the outermost forward (a forward inside it is not told: it is counted by the outer one's mode).
* :meth:`~FlopCounter.forward_ended` from the module's forward hook, with the forward's output, whose
  backward graph is then watched.
* :meth:`~FlopCounter.backward_ended` when ``engine.backward()`` returns, when a torch-style backward
  (``engine.scale(loss).backward()``) is done, and again when ``engine.step()`` starts: the window ends
  (a window no backward reached is dropped, and counted again next time).
* :meth:`~FlopCounter.figures` when the micro step's record closes.
* :meth:`~FlopCounter.discard` when the hub detaches.

A forward without a backward to follow -- under ``torch.no_grad()`` or with no output that needs a
gradient -- is a micro step of its own, forward FLOPs only (``MicroStepFlops.backward`` False).

Jobs whose input shapes change every step (batches padded to their longest sequence) would count
all the time: at most ``max_counted_shapes`` distinct signatures are counted exactly (and at most twice
that many counting attempts are made); beyond that a signature's FLOPs are scaled linearly from the
counted one of the same kind (gradients, training flag) with the nearest token count (sample count
where there are no tokens), ``flops_source`` ``"scaled"`` rather than ``"counted"``, said once in a
log line.  Linear scaling is exact for the dense layers and underestimates attention, whose FLOPs
grow with the square of the sequence length.

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
import logging
import threading
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

import torch

from ...logging import log_dist, logger
from .batch import inspect_batch
from .counting import BackwardWatch, Tally, attention_unit, pop_if_on_top, push_counting

__all__ = ["DEFAULT_MAX_COUNTED_SHAPES", "FlopCounter", "MicroStepFlops", "inspect_batch"]

DEFAULT_MAX_COUNTED_SHAPES = 8
"""Distinct input signatures counted exactly before later ones are scaled."""
_SCALED_KEPT = 4096
"""Scaled figures remembered (beyond it each is scaled again: a scan of ``max_counted_shapes`` entries)."""
_said_uncounted: Set[str] = set()  # operator names already named in this process's log


class MicroStepFlops(NamedTuple):
    """What one micro step did: its model and hardware FLOPs and the batch it took."""

    flops: Optional[int]
    """Model FLOPs: forwards (and, with ``backward``, the backward) without recompute; None when unknown."""
    flops_source: Optional[str]
    """``"counted"`` (this signature was counted), ``"scaled"`` (from the nearest counted signature), ``"window"``
    (``flops`` 0: a record that closed inside a window still awaiting its backward -- the first of two
    forwards -- whose FLOPs are on the record where the window ends)."""
    backward: bool
    """Whether ``flops`` includes a backward."""
    tokens: Optional[int]
    samples: Optional[int]
    hardware_flops: Optional[int] = None
    """``flops`` plus what activation checkpointing recomputed (the HFU numerator)."""
    uncounted_ops: Tuple[str, ...] = ()
    """Operators without a FLOP formula met by this signature's count (on the counted micro step only)."""
    analytic_flops: int = 0
    """The part of ``flops`` that is the analytic attention term (on the counted micro step only)."""

    def record_fields(self) -> Dict[str, Any]:
        """The record's fields (docs/step_records.md): the names of uncounted operators only where there are."""
        fields: Dict[str, Any] = {"flops": self.flops, "flops_source": self.flops_source,
                                  "hardware_flops": self.hardware_flops, "tokens": self.tokens,
                                  "samples": self.samples}
        if self.uncounted_ops:
            fields["flops_uncounted_ops"] = list(self.uncounted_ops)
        if self.analytic_flops:
            fields["flops_analytic"] = self.analytic_flops
        return fields


class _Count(NamedTuple):
    flops: int
    hardware: int
    backward: bool
    size: Optional[int]  # tokens, else samples, of the counted batch: what scaling divides by
    source: str
    uncounted: Tuple[str, ...] = ()
    analytic: int = 0


class _Forward:
    """One forward of a counting window: its tally and whether the window's backward reached it."""

    __slots__ = ("tally", "reached")

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.reached = False


class _MicroStep:
    """The micro step in progress: its key and batch, its count once known, and its window's forwards."""

    __slots__ = ("key", "tokens", "samples", "train", "count", "counting", "attention", "forwards", "watch",
                 "reached", "finished")

    def __init__(self, key: tuple, tokens: Optional[int], samples: Optional[int], train: bool) -> None:
        self.key = key
        self.tokens = tokens
        self.samples = samples
        self.train = train  # a train forward (train mode, gradients on): its window awaits a backward
        self.count: Optional[_Count] = None
        self.counting = False  # this micro step's window is counted
        self.attention: Optional[int] = None
        self.forwards: List[_Forward] = []
        self.watch: Optional[BackwardWatch] = None
        self.reached = False  # a backward reached one of its forwards
        self.finished = False  # its window ended

    @property
    def size(self) -> Optional[int]:
        return self.tokens if self.tokens is not None else self.samples

    def reach(self, forward: _Forward) -> None:
        """A backward node of ``forward``'s graph starts (maybe on an autograd device thread)."""
        forward.reached = self.reached = True

    def end(self) -> None:
        self.finished = True
        if self.watch is not None:
            self.watch.close()


class FlopCounter:
    """Counts each new signature's micro step (module doc), then reuses the count."""

    def __init__(self, max_counted_shapes: int = DEFAULT_MAX_COUNTED_SHAPES) -> None:
        if type(max_counted_shapes) is not int or max_counted_shapes < 1:
            raise ValueError(f"max_counted_shapes must be an integer >= 1, got {max_counted_shapes!r}")
        self.max_counted_shapes = max_counted_shapes
        self.counting_attempts = 0
        """Micro steps counted so far (each costs the mode's dispatch)."""
        self._known: Dict[tuple, _Count] = {}
        self._counted: List[Tuple[tuple, _Count]] = []
        self._current: Optional[_MicroStep] = None  # whose figures() are asked for
        self._window: Optional[_MicroStep] = None  # the train micro step whose backward is awaited
        self._mode: Optional[Any] = None  # the counting mode pushed inside a forward
        self._mode_thread: Optional[int] = None
        self._scaling_said = False

    @property
    def counting(self) -> bool:
        """Whether a count is in progress: a counted forward runs, or a counted window awaits its backward."""
        window = self._window
        return self._mode is not None or (window is not None and window.counting and not window.finished)

    @property
    def counted_shapes(self) -> int:
        """Distinct signatures counted exactly so far."""
        return len(self._counted)

    # ---- the engine's moments ---------------------------------------------------------------------------

    def forward_started(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """The engine's (outermost) forward of ``module`` starts: another forward of the open window, or a new micro
        step to look up, count or scale.  A forward inside it (Lightning's ``training_step`` calling the module that
        the engine called) is not told (the hooks tell the outermost only): counted by the outer one's mode."""
        grad = torch.is_grad_enabled()
        train = grad and module.training  # a backward is awaited (an eval forward with gradients on awaits none)
        window = self._window
        if train and window is not None and not window.reached and not window.finished:
            self._current = window  # its backward has not come: this forward is the same micro step's
            if window.counting:
                self._enter_forward(window)
            return
        shapes, tokens, samples = inspect_batch(args, kwargs)
        micro = self._current = _MicroStep((grad, module.training, shapes), tokens, samples, train)
        if train:
            if window is not None and not window.finished:
                window.end()
            self._window = micro
        micro.count = self._known.get(micro.key)
        if micro.count is not None:
            return
        if len(self._counted) < self.max_counted_shapes and self.counting_attempts < 2 * self.max_counted_shapes:
            self.counting_attempts += 1
            micro.counting = True
            micro.attention = attention_unit(module, tokens, samples)
            self._enter_forward(micro)
        else:
            micro.count = self._scaled(micro)

    def forward_ended(self, output: Any) -> None:
        """The counted forward returned ``output``: its backward graph is watched; a forward with no backward
        to follow is counted now."""
        micro = self._current
        if micro is None or not micro.counting or not micro.forwards or micro.finished or self._mode is None:
            return
        forward = micro.forwards[-1]
        if micro.train:
            if micro.watch is None:
                micro.watch = BackwardWatch(Tally(backward=True, attention=micro.attention))
            if micro.watch.add(output, functools.partial(micro.reach, forward)):
                return
        if forward is micro.forwards[0]:
            self._keep(micro, backward=False)
            micro.end()

    def backward_ended(self) -> None:
        """A backward ended (or ``engine.step()`` starts): the window ends; its count is kept when the backward
        reached it, otherwise it is dropped (counted again next time)."""
        window = self._window
        if window is None or window.finished:
            return
        if window.counting and window.reached:
            self._keep(window, backward=True)
        window.end()

    def figures(self) -> Optional[MicroStepFlops]:
        """The current micro step's figures (None before any forward); ``flops`` None while its count is
        not complete or when there was nothing to scale from."""
        micro = self._current
        if micro is None:
            return None
        count = micro.count
        if micro.train and not micro.finished and (count is None or count.backward):
            # a record closing inside a window that awaits its backward (the first of two forwards)
            return MicroStepFlops(0, "window", False, micro.tokens, micro.samples, 0)
        if count is None:
            return MicroStepFlops(None, None, False, micro.tokens, micro.samples)
        counted_here = micro.counting
        return MicroStepFlops(count.flops, count.source, count.backward, micro.tokens, micro.samples, count.hardware,
                              count.uncounted if counted_here else (), count.analytic if counted_here else 0)

    def forward_left(self) -> None:
        """The engine's outermost forward is over, returned or raised: its counting mode is popped (what follows,
        the loss and the backward, is counted by the window's backward watch)."""
        self._leave_forward()

    def discard(self) -> None:
        """Forget the micro step in progress and leave a counting mode still on (the hub detaches).  Counts kept
        so far stay."""
        self._leave_forward()
        self._end_window()
        self._current = None

    # ---- counting ---------------------------------------------------------------------------------------

    def _enter_forward(self, micro: _MicroStep) -> None:
        forward = _Forward(Tally(backward=False, attention=micro.attention))
        micro.forwards.append(forward)
        self._mode = push_counting(forward.tally)
        self._mode_thread = threading.get_ident()

    def _leave_forward(self) -> None:
        """Pop the forward's counting mode (on the thread it was pushed on, if it is the innermost mode)."""
        mode = self._mode
        if mode is not None and threading.get_ident() == self._mode_thread and pop_if_on_top(mode):
            self._mode = None

    def _end_window(self) -> None:
        window, self._window = self._window, None
        if window is not None and not window.finished:
            window.end()

    def _keep(self, micro: _MicroStep, backward: bool) -> None:
        forwards = [forward for forward in micro.forwards if forward.reached] if backward else micro.forwards[:1]
        tallies = [forward.tally for forward in forwards]
        if backward and micro.watch is not None:
            tallies.append(micro.watch.tally)
        flops = sum(tally.flops for tally in tallies)
        uncounted: Dict[str, int] = {}
        for tally in tallies:
            for name, calls in tally.uncounted.items():
                uncounted[name] = uncounted.get(name, 0) + calls
        count = _Count(flops, flops + sum(tally.recompute for tally in tallies), backward, micro.size, "counted",
                       tuple(sorted(uncounted)), sum(tally.analytic for tally in tallies))
        micro.count = count
        self._known[micro.key] = count
        self._counted.append((micro.key, count))
        _say_uncounted(uncounted, micro.attention is not None)

    def _scaled(self, micro: _MicroStep) -> Optional[_Count]:
        """The count of the nearest counted signature of the same kind, scaled by tokens (or samples)."""
        size = micro.size
        kind = micro.key[:2]
        candidates = [count for key, count in self._counted if key[:2] == kind and count.size]
        if size is None or not candidates:
            return None
        nearest = min(candidates, key=lambda count: abs(count.size - size))
        ratio = size / nearest.size
        count = _Count(round(nearest.flops * ratio), round(nearest.hardware * ratio), nearest.backward, size, "scaled")
        if len(self._known) < _SCALED_KEPT:
            self._known[micro.key] = count
        if not self._scaling_said:
            self._scaling_said = True
            logger.info("ds_profutils: %d input shapes counted exactly; the FLOPs of further shapes are scaled "
                        "from the counted shape with the nearest token (or sample) count (flops_source "
                        "\"scaled\": exact for dense layers, low for attention on longer sequences)",
                        len(self._counted))
        return count


def _say_uncounted(uncounted: Mapping[str, int], analytic: bool) -> None:
    """Name, once per name in this process and on rank 0 (every rank meets the same operators), the operators a
    count met without a FLOP formula."""
    new = sorted(set(uncounted) - _said_uncounted)
    if not new:
        return
    _said_uncounted.update(new)
    attention = [name for name in new if "attention" in name.lower() or "attn" in name.lower()]
    how = ("an analytic attention term from the model's config (heads, head dim) and the sequence length is added "
           "for " + ", ".join(attention)) if attention and analytic else (
               "their FLOPs are missing from flops and MFU is understated" if attention else
               "their FLOPs (if any) are missing from flops")
    names = ", ".join(f"{name} ({uncounted[name]} calls)" for name in new)
    log_dist(f"ds_profutils: FLOPs of operators without a formula are not counted: {names}; {how} (records: "
             "flops_uncounted_ops)", ranks=[0], level=logging.WARNING)
