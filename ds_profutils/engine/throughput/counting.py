"""What a counting window counts, and how, without ever leaving a dispatch mode on a thread.

torch's FlopCounterMode counts what runs while it is pushed on a thread's dispatch-mode stack.  Left
pushed from a forward to its backward, it stays on the training thread over the user's own code
(the loss, a teacher's forward, an optimizer call), and an error there -- an OOM most often --
leaves it pushed for good: every later operator of the thread goes through its Python dispatch.
So the mode here (torch's own ``_FlopCounterMode``, with its formulas, decompositions and skips, so
a count is what FlopCounterMode would count) is only ever pushed where our code holds both ends:

* **a forward of the engine's module**: pushed by the forward pre-hook, popped from the hub's forward hook
  registered with ``always_call`` (torch runs it when the forward raises an Exception, too; after a
  BaseException, at the engine's next backward or step);
* **each backward node of that forward's graph**: pushed by the node's pre-hook, popped by its
  post-hook.  The autograd engine runs every node under its own thread-local-state guard, which puts
  the thread's dispatch modes back as they were when the node ends -- also when it raises -- so no
  mode outlives the node, on the training thread or on an autograd device thread.

Between them nothing is pushed: the user's code between forward and backward is not counted (a
teacher's forward there is not the student's work), which is what "model FLOPs" means.

Each forward and the window's backward fill a :class:`Tally`.  In the backward, operators that run
with gradients enabled are a forward recomputed by activation checkpointing (torch's
``checkpoint``, reentrant or not, and DeepSpeed's both recompute under ``torch.enable_grad()``,
while a backward node runs with gradients disabled unless ``create_graph=True``): they go to
``recompute`` -- hardware FLOPs, not model FLOPs.  A backward with ``create_graph=True`` (double
backward: gradient penalties) would count its whole backward as recompute.

Operators without a FLOP formula are named (:attr:`Tally.uncounted`) when they look like work: an
attention operator (CPU SDPA's ``_scaled_dot_product_flash_attention_for_cpu``, flash-attn >= 2.6's
``flash_attn::_flash_attn_forward``) or any operator of a non-torch namespace (a custom op).  For an
attention operator an analytic term is added where the window knows its attention size
(:func:`attention_unit`: batch x sequence^2 x heads x head dim, from the model's config and the
input's shape): 4 units per forward call (QK^T and AV, 2 FLOPs per multiply-add: FlopCounterMode's
SDPA formula without a causal mask) and 8 per backward call.
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import _FlopCounterMode, flop_registry

from ..hooks import grad_outputs

__all__ = ["BackwardWatch", "Tally", "attention_unit", "pop_if_on_top", "push_counting"]

_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "c10d", "_c10d_functional", "c10d_functional", "profiler",
                               "quantized", "_quantized", "rngprims", "debugprims", "inductor", "higher_order",
                               "_dtensor", "_functional_collectives"})
"""Operator namespaces of torch itself: an operator of another namespace is a custom op."""
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_BACKWARD = re.compile(r"backward|bwd", re.IGNORECASE)
_NAMES: Dict[Any, Optional[str]] = {}  # operator packet -> its name when it is to be named, else None


def _uncounted_name(packet: Any) -> Optional[str]:
    """The operator's qualified name when an operator without a formula is worth naming (module doc)."""
    if packet in _NAMES:
        return _NAMES[packet]
    name = getattr(packet, "_qualified_op_name", None) or str(packet)
    namespace = name.split("::", 1)[0] if "::" in name else "aten"
    named = name if (_ATTENTION.search(name) or namespace not in _TORCH_NAMESPACES) else None
    _NAMES[packet] = named
    return named


class Tally:
    """The FLOPs counted in one forward, or in one window's backward (``backward``): model work in ``flops``,
    recompute in ``recompute``, the analytic attention term's share of both in ``analytic``, and the
    operators without a formula by name and calls in ``uncounted``.

    It is the ``counter`` torch's ``_FlopCounterMode`` reports to: ``flop_registry``, ``flop_counts`` (which it
    touches for higher-order operators only) and ``_count_flops``.
    """

    flop_registry = flop_registry

    def __init__(self, backward: bool, attention: Optional[int]) -> None:
        self.backward = backward
        self.attention = attention  # batch x sequence^2 x heads x head dim, where known
        self.flops = 0
        self.recompute = 0
        self.analytic = 0
        self.uncounted: Dict[str, int] = {}
        self.flop_counts: Dict[str, Dict[Any, int]] = {}

    def _count_flops(self, packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        formula = flop_registry.get(packet)
        flops = name = None
        if formula is not None:
            try:  # inside the user's forward or backward: a formula's error is an uncounted operator, never theirs
                flops = formula(*args, **kwargs, out_val=out)
            except Exception:  # noqa: BLE001 - profiling must never break the training run
                name = getattr(packet, "_qualified_op_name", None) or str(packet)
        if flops is None:
            name = name or _uncounted_name(packet)
            if name is None:
                return out
            self.uncounted[name] = self.uncounted.get(name, 0) + 1
            if self.attention is None or not _ATTENTION.search(name):
                return out
            flops = (8 if _BACKWARD.search(name) else 4) * self.attention
            self.analytic += flops
        if self.backward and torch.is_grad_enabled():
            self.recompute += flops
        else:
            self.flops += flops
        return out


def push_counting(tally: Tally) -> Any:
    """Push a counting mode feeding ``tally`` on this thread; pop it with :func:`pop_if_on_top`."""
    mode = _FlopCounterMode(tally)
    mode.__enter__()
    return mode


def pop_if_on_top(mode: Any) -> bool:
    """Pop ``mode`` if it is this thread's innermost dispatch mode (a mode pushed after it and still on, a
    program's own, is never popped in its place); whether it was popped."""
    if _get_current_dispatch_mode() is not mode:
        return False
    mode.__exit__(None, None, None)
    return True


class BackwardWatch:
    """Counts the backward nodes of a window's forwards: each node runs under a counting mode (module doc).

    :meth:`add` hooks the graph behind a forward's outputs; ``reached`` is called when one of its nodes
    starts (maybe on an autograd device thread).  Nodes reached from two forwards are hooked twice: a
    per-thread depth keeps one mode pushed.  :meth:`close` takes the hooks off; the watch keeps no node
    (a graph the program drops, after an error, is freed as without us).
    """

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.active = True
        self._handles: List[Any] = []
        self._local = threading.local()

    def add(self, output: Any, reached: Callable[[], None]) -> bool:
        """Hook every backward node reachable from ``output``'s tensors that need a gradient (gradient
        accumulation into parameters aside: no FLOPs); False where nothing needs one."""
        roots = [tensor.grad_fn for tensor in grad_outputs(output) if tensor.grad_fn is not None]
        if not roots:
            return False
        enter = functools.partial(self._enter, reached)
        seen = set()
        pending = roots
        while pending:
            node = pending.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "AccumulateGrad":
                continue
            self._handles.append(node.register_prehook(enter))
            self._handles.append(node.register_hook(self._leave))
            pending.extend(next_node for next_node, _ in node.next_functions)
        return True

    def _enter(self, reached: Callable[[], None], _grad_outputs: Any) -> None:
        if not self.active:
            return
        reached()
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        if depth == 0:
            local.mode = push_counting(self.tally)

    def _leave(self, _grad_inputs: Any, _grad_outputs: Any) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            return
        local.depth = depth - 1
        if depth == 1:
            pop_if_on_top(local.mode)
            local.mode = None

    def close(self) -> None:
        """No more counting: the hooks come off (those of a graph already freed are gone with it)."""
        self.active = False
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def attention_unit(module: torch.nn.Module, tokens: Optional[int], samples: Optional[int]) -> Optional[int]:
    """batch x sequence^2 x heads x head dim of a forward of ``module`` on ``samples`` rows of ``tokens`` tokens,
    where the module carries a transformers-style ``config`` (``num_attention_heads`` and ``head_dim``, else
    ``hidden_size`` / heads); None otherwise."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not tokens or not samples or not isinstance(heads, int) or heads < 1:
        return None
    head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int):
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int):
            return None
        head_dim = hidden // heads
    sequence = tokens // samples
    return samples * sequence * sequence * heads * head_dim
