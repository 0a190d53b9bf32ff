"""The hooks ``attach`` puts on one engine, once, for every feature that follows the engine's steps.

The recorder, live figures, hang watchdog, snapshots and engine-driven profiler need the same moments: a forward
starts and ends, ``engine.backward()`` returns, ``engine.step()`` starts and returns, an error leaves one of them.
:class:`EngineHooks` puts one forward pre-hook (prepended: before DeepSpeed's own, which resets the ZeRO-3
coordinator's counters; with the keyword arguments the FLOP counter keys its counts by), one forward hook (the
output's gradients tell where the backward ends) and wrappers of ``engine.forward`` (torch calls an always-call hook
on an ``Exception`` only: a forward a caught ``KeyboardInterrupt`` leaves ends there, so no counting mode or running
engine stays behind it), ``engine.backward`` (Accelerate, so the Trainer, calls ``step()`` at the accumulation
boundary only), ``engine.step`` and the engine's own work between steps (``_OWN_WORK``: a save is a part of the gap).

The module's hooks hold :class:`EngineHooks` weakly, and it holds the engine weakly: a copy of the module
(``copy.deepcopy``, pickling, ``AveragedModel``: EMA models, teacher copies) copies no engine, process group or
listener, and gets hooks that do nothing, as without ``attach``.  Removing them restores what was there; a wrapper
put over ours after attach keeps calling ours, which then passes calls through.  The hooks say which engine runs now
(:data:`running`: process-wide, DeepSpeed's backward hooks run on autograd's threads), so a collective issued there
is that engine's (actor and critic steps interleave).

A listener's error never reaches the training loop: it is logged and the listener stopped.  A signal handler's
exception while a listener ran (torch's DataLoader SIGCHLD, a program's) goes on as without ds_profutils; one an
engine-driven profiler's guard raised ends that run first (:func:`..torch_profiler.calls.end_run_raised_by`).
"""
from __future__ import annotations

import functools
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.autograd.graph import register_multi_grad_hook

from ..outputs import BETWEEN_STEPS
from ..torch_profiler.calls import end_run_raised_by, raised_by_signal_handler
from .step import optimizer_step_taken

__all__ = ["BETWEEN_STEPS", "EngineHooks", "Listener", "OptimizerStepListener", "do_nothing", "grad_outputs",
           "on_backward_end", "running"]

_ABSENT = object()


def grad_outputs(output: Any) -> List[torch.Tensor]:
    """The tensors of a forward's output (nested tuples, lists, dicts, ModelOutputs) that need a gradient."""
    found: List[torch.Tensor] = []
    pending = [output]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        elif isinstance(value, (tuple, list)):
            pending.extend(value)
        elif isinstance(value, Mapping):
            pending.extend(value.values())
    return found


def on_backward_end(output: Any, done: Callable[[], None]) -> Optional[Any]:
    """Call ``done`` when a backward that reaches ``output``'s tensors that need a gradient is done (an
    autograd-engine callback queued as it reaches them), whichever call started the backward:
    ``engine.backward()`` or a torch-style ``loss.backward()``.  Both may run on an autograd device thread.
    Returns the hook's handle (remove it when the forward is forgotten), None where nothing needs a gradient."""
    tensors = grad_outputs(output)
    if not tensors:
        return None

    def on_gradient(_grad: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(done)

    if len(tensors) == 1:  # the usual output (a loss, logits): its node's pre-hook, 0.6x a tensor hook's cost
        node = tensors[0].grad_fn
        return node.register_prehook(on_gradient) if node is not None else tensors[0].register_hook(on_gradient)
    return register_multi_grad_hook(tensors, on_gradient, mode="any")


def do_nothing() -> None:
    """A callback with nothing to do (a listener with nothing to close)."""


class _Running:
    """``engine_id``: ``id()`` of the engine whose forward, backward or step runs now; None outside all."""

    __slots__ = ("engine_id", )

    def __init__(self) -> None:
        self.engine_id: Optional[int] = None


running = _Running()
"""Which engine runs now (see the module doc); read by the collective wrappers on every collective."""


class Listener:
    """What a feature hears of an engine; each method is optional (the base does nothing)."""

    def forward_started(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The engine's module's outermost forward starts with these inputs (FLOPs and tokens are read from them)."""

    def forward_ended(self, module: torch.nn.Module, output: Any) -> None:
        """The forward returned ``output`` (whose gradients tell where its backward ends)."""

    def forward_left(self) -> None:
        """The forward is over, returned or raised (after ``forward_ended`` where it returned)."""

    def backward_ended(self) -> None:
        pass

    def step_started(self) -> None:
        pass

    def step_ended(self) -> None:
        pass

    def optimizer_step_ended(self, global_step: int) -> None:
        """Global step ``global_step`` is done: the ``step()`` that just ended moved the engine's ``global_steps`` on
        (Accelerate calls it at every micro step; only the boundary's counts).  Told right after its ``step_ended``."""

    def step_listeners_done(self) -> None:
        """Every listener heard ``step_ended``: what ran since the step's end was ours (a profiler window's export)."""

    def failed(self, exc: BaseException) -> None:
        """An error (any BaseException) leaves the engine's forward, backward, step or own work."""

    def checkpoint_saved(self, elapsed_ns: int) -> None:
        """``engine.save_checkpoint()`` returned (or raised) after ``elapsed_ns``."""

    def stop_after_error(self, exc: Exception) -> None:
        """This listener raised ``exc``: stop listening (the hooks remove it afterwards)."""


class OptimizerStepListener(Listener):
    """A listener that reads the global step count of ``engine`` (held weakly) outside the step's end (the
    optimizer step's number comes with :meth:`Listener.optimizer_step_ended`)."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def _global_steps(self) -> Optional[int]:
        return getattr(self._engine(), "global_steps", None)  # None once the engine is collected


class _ModuleHook:
    """A hook on the engine's module that calls one method of its :class:`EngineHooks`, held weakly.  A copy
    (deepcopy, pickle) is inert: it belongs to a copy of the module, whose forwards are not the engine's."""

    __slots__ = ("_hooks", "_method")

    def __init__(self, hooks: Optional["EngineHooks"], method: str) -> None:
        self._hooks, self._method = (None if hooks is None else weakref.ref(hooks)), method

    def __call__(self, *args: Any) -> None:
        hooks = None if self._hooks is None else self._hooks()
        if hooks is not None:
            getattr(hooks, self._method)(*args)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_ModuleHook":
        return _ModuleHook(None, self._method)

    def __reduce__(self) -> Tuple[Any, Tuple[None, str]]:
        return _ModuleHook, (None, self._method)


# Calls between steps whose collectives are the engine's: checkpoints, 16-bit weights gathered (the Trainer's)
_OWN_WORK = ("save_checkpoint", "load_checkpoint", "save_16bit_model", "_zero3_consolidated_16bit_state_dict")
_EVENTS = ("forward_started", "forward_ended", "forward_left", "backward_ended", "step_started", "step_listeners_done",
           "failed", "checkpoint_saved")  # the Listener methods EngineHooks._tell tells
_STEP_END = ("step_ended", "optimizer_step_ended")  # the Listener methods told per listener (EngineHooks._step_ended)


class EngineHooks:
    """The hooks on one engine (held weakly) and the listeners they tell, in the order they were added.  ``phase``:
    "forward", "backward", "step" or :data:`BETWEEN_STEPS` (attribute writes the hang watchdog's thread reads)."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)
        self.listeners: List[Listener] = []
        self._told: Dict[str, List[Callable[..., None]]] = {}  # per event, the listeners' methods (no base no-ops)
        self._step_end: List[tuple] = []  # per listener hearing a step's end: it, its two methods of _STEP_END
        self.phase = BETWEEN_STEPS
        self._active = True
        self._engine_id = id(engine)
        self._outside: Optional[int] = None  # the engine running when this one's (outermost) forward started
        self._forwards = 0  # this engine's module forwards running now (a forward inside a forward: 2)
        self._in_backward = False  # inside engine.backward(), which tells its own end
        self._backward_watch: Optional[Any] = None  # the last train forward's outputs, watched for a backward
        self._handles: List[Any] = []
        self._wrapped: List[tuple] = []  # (attribute, what the instance held before, our wrapper)
        self._hook(engine)
        for name in _OWN_WORK:
            if hasattr(engine, name):  # every DeepSpeed engine, a pipeline's too
                self._wrap(name, functools.partial(self._around_own_work, name == "save_checkpoint"))

    def _hook(self, engine: Any) -> None:
        """Put the hooks on: the module's forward hooks, and wrappers of ``backward`` and ``step`` (a pipeline's
        hooks put others: :class:`..pipeline.PipelineHooks`)."""
        module = engine.module
        self._handles = [
            module.register_forward_pre_hook(_ModuleHook(self, "_forward_started"), prepend=True, with_kwargs=True),
            module.register_forward_hook(_ModuleHook(self, "_forward_ended")),
            # also when the forward raises: no later collective is this engine's by mistake
            module.register_forward_hook(_ModuleHook(self, "_forward_left"), always_call=True),
        ]
        self._wrap("forward", self._around_call)
        self._wrap("backward", self._around_backward)
        self._wrap("step", self._around_step)

    @property
    def engine(self) -> Any:
        """The engine (None once collected)."""
        return self._engine()

    def add(self, listener: Listener) -> None:
        """Tell ``listener`` from now on (and watch errors if it does)."""
        self.listeners.append(listener)
        self._listen()

    def _listen(self) -> None:
        """Who is told what, from the listeners now (after each change of them); the base's methods do nothing."""
        own = [{event: getattr(listener, event) for event in _EVENTS + _STEP_END
                if getattr(type(listener), event) is not getattr(Listener, event)} for listener in self.listeners]
        self._told = {event: [told[event] for told in own if event in told] for event in _EVENTS}
        self._step_end = [(listener, told.get("step_ended"), told.get("optimizer_step_ended"))
                          for listener, told in zip(self.listeners, own) if told.keys() & _STEP_END]

    def _wrap(self, attribute: str, around: Callable[..., Any]) -> None:
        engine = self.engine
        before = vars(engine).get(attribute, _ABSENT)
        original = getattr(engine, attribute)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return original(*args, **kwargs)
            return around(original, *args, **kwargs)

        setattr(engine, attribute, wrapper)
        self._wrapped.append((attribute, before, wrapper))

    def remove(self) -> None:
        """Take every hook off and restore what the engine held (see the module doc)."""
        self._active = False
        self.listeners = []
        self._told, self._step_end = {}, []
        if running.engine_id == self._engine_id:  # removed inside its own forward (a listener failed there)
            running.engine_id = self._outside
        for handle in self._handles:
            handle.remove()
        self._forget_backward_watch()
        engine = self.engine
        for attribute, before, wrapper in reversed(self._wrapped if engine is not None else []):
            if vars(engine).get(attribute) is not wrapper:
                continue  # wrapped again since: ours stays in the chain, passing calls through
            if before is _ABSENT:
                delattr(engine, attribute)
            else:
                setattr(engine, attribute, before)
        self._wrapped = []

    def _tell(self, event: str, *args: Any) -> None:
        for told in self._told.get(event, ()):  # a list replaced, never changed, when a listener is dropped
            try:
                told(*args)
            except Exception as exc:
                self._listener_failed(told.__self__, exc)

    def _listener_failed(self, listener: Listener, exc: Exception) -> None:
        """``listener`` raised ``exc``: what a signal handler raised goes on, as without ds_profutils; else it stops."""
        if raised_by_signal_handler(exc):
            raise exc
        self._drop(listener, exc)

    def _drop(self, listener: Listener, exc: Exception) -> None:
        """``listener`` failed: stop it; with none left the engine is DeepSpeed's again at once."""
        if listener in self.listeners:  # not where a listener removed the hooks since (removing every listener)
            self.listeners.remove(listener)
        self._listen()
        listener.stop_after_error(exc)
        if not self.listeners:
            self.remove()

    def _forward_started(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Listeners hear of the outermost forward only: one inside it (Lightning's ``training_step`` calling the
        module the engine called) is part of it."""
        if self._active:
            self._forwards += 1
            if self._forwards > 1:
                return
            self._forget_backward_watch()
            self._outside, running.engine_id = running.engine_id, self._engine_id
            self.phase = "forward"
            self._tell("forward_started", module, args, kwargs)

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active and self._forwards == 1:
            self._tell("forward_ended", module, output)
            if self._active and module.training and torch.is_grad_enabled():  # inactive: its last listener failed
                self._backward_watch = on_backward_end(output, self._torch_style_backward_ended)
                self.phase = "backward"  # to come

    def _torch_style_backward_ended(self) -> None:
        """A backward through this forward's outputs is done: outside ``engine.backward()`` (a torch-style
        ``loss.backward()``) nothing else tells its end."""
        if self._active and not self._in_backward:
            self.phase = BETWEEN_STEPS
            self._tell("backward_ended")

    def _forget_backward_watch(self) -> None:
        if self._backward_watch is not None:
            self._backward_watch.remove()
            self._backward_watch = None

    def _forward_left(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._forwards > 1:
            self._forwards -= 1
        else:
            self._left_forwards()

    def _left_forwards(self) -> None:
        """The outermost forward is over: it returned or raised (a BaseException: as it leaves the engine's call), or
        (no forward of this engine runs while its backward or step does) a compiled forward's error left it."""
        if self._forwards:
            self._forwards = 0
            if self.phase == "forward":  # no backward to come: an eval forward, or one that raised
                self.phase = BETWEEN_STEPS
            if running.engine_id == self._engine_id:
                running.engine_id = self._outside
            self._tell("forward_left")

    def _around_backward(self, backward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._forwards:  # (its own test too: a call fewer on the step path)
            self._left_forwards()
        outside, running.engine_id = running.engine_id, self._engine_id
        self._in_backward, self.phase = True, "backward"
        try:
            result = self._around_call(backward, *args, **kwargs)
        finally:
            running.engine_id = outside
            self._in_backward, self.phase = False, BETWEEN_STEPS
        self._tell("backward_ended")
        return result

    def _around_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._forwards:  # (as in _around_backward)
            self._left_forwards()
        outside, running.engine_id = running.engine_id, self._engine_id
        self.phase, before, ended = "step", getattr(self._engine(), "global_steps", None), True
        try:
            self._tell("step_started")
            return self._around_call(step, *args, **kwargs)
        except BaseException:  # unfinished, but for one raised after its optimizer step (a monitor's write)
            ended = optimizer_step_taken(self._engine(), before)
            raise
        finally:
            running.engine_id = outside
            self.phase = BETWEEN_STEPS
            if ended:
                self._step_ended(before)

    def _step_ended(self, steps_before: Optional[int]) -> None:
        """A step ended (or raised after its optimizer step): each listener in turn hears ``step_ended``, then
        ``optimizer_step_ended`` where ``global_steps`` moved from ``steps_before`` (each acts on what those before it
        did: a profiler's window starts once a capture ended), then all ``step_listeners_done``."""
        moved = optimizer_step_taken(self._engine(), steps_before)
        for listener, step_ended, optimizer_step_ended in self._step_end:  # replaced, never changed (as _told)
            try:
                if step_ended is not None:
                    step_ended()
                if moved and optimizer_step_ended is not None:
                    optimizer_step_ended(steps_before)
            except Exception as exc:
                self._listener_failed(listener, exc)
        self._tell("step_listeners_done")

    def _around_own_work(self, saves: bool, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The engine runs (its collectives are no waits of the gap); a save's time is told, also where it raises.
        Own work inside an engine call (``save_16bit_model``'s gather) is that call's: an error is told once."""
        if running.engine_id == self._engine_id:
            return call(*args, **kwargs)
        start, outside, running.engine_id = perf_counter_ns(), running.engine_id, self._engine_id
        try:
            return self._around_call(call, *args, **kwargs)  # an error in it is told as one in a step is
        finally:
            running.engine_id = outside
            if saves:
                self._tell("checkpoint_saved", perf_counter_ns() - start)

    def _around_call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            self._left_forwards()  # an Exception left the forward in the always-call hook already, not a BaseException
            for told in self._told.get("failed", ()):
                try:
                    told(exc)
                except Exception as error:  # the engine's own error goes on, unchanged
                    self._drop(told.__self__, error)
            end_run_raised_by(exc)  # an interruption unwinding: the engine-driven profiler's window, first
            raise
