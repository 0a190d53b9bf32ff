"""Where the live events go: DeepSpeed's monitor and one console line (the frameworks' sinks live in
:mod:`ds_profutils.integrations.live_sinks`, beside the adapters that know the framework objects).

A sink is anything with ``write(events)``; LiveMetrics calls it on rank 0 only, once per interval, with
all of the interval's events (one global step).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence

from ...diagnosis.causes import LIVE_CAUSES
from .interval import Event
from ...units import flops_rate

__all__ = ["ConsoleSink", "DeepSpeedMonitorSink", "LiveSink", "console_line", "monitor_sink"]


class LiveSink(Protocol):
    """A destination of the live events."""

    def write(self, events: List[Event]) -> None:
        """Send one interval's events ``(name, value, global_step)``."""


class DeepSpeedMonitorSink:
    """DeepSpeed's ``MonitorMaster`` (``engine.monitor``): every monitor the ds_config enables
    (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``) gets the events beside DeepSpeed's own.

    On DeepSpeed's step axis: its monitors' events carry ``engine.global_samples`` (its
    ``Train/Samples/...`` series; Comet's writer calls the field ``engine_global_samples``), and W&B drops
    a point whose step is below one already logged.  An event's global step (the step as the records
    number it: ``engine.global_steps`` when it began) becomes the samples trained when it ended, counted
    back from the engine's present ones, since a deferred interval is written after later steps.  W&B
    keeps no point below a step it has logged, and DeepSpeed logs its own at the present samples, so W&B's
    monitor gets a deferred interval's events at the present samples (the others at their own).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def write(self, events: List[Event]) -> None:
        engine = self.engine
        later_steps = engine.global_steps - (events[0][2] + 1)
        samples = engine.global_samples - later_steps * engine.train_batch_size()
        monitor = engine.monitor
        wandb = getattr(monitor, "wandb_monitor", None)
        if wandb is None or samples >= engine.global_samples:
            monitor.write_events([(name, value, samples) for name, value, _ in events])
            return
        wandb.write_events([(name, value, engine.global_samples) for name, value, _ in events])
        for other in (monitor.tb_monitor, monitor.csv_monitor, monitor.comet_monitor):
            if other is not None:
                other.write_events([(name, value, samples) for name, value, _ in events])


def monitor_sink(engine: Any) -> Optional[DeepSpeedMonitorSink]:
    """The engine's monitor as a sink, or None where the ds_config enables none (DeepSpeed builds a
    ``MonitorMaster`` for every engine; its ``enabled`` says whether any monitor is on)."""
    monitor = getattr(engine, "monitor", None)
    return DeepSpeedMonitorSink(engine) if monitor is not None and getattr(monitor, "enabled", False) else None


def _format(figures: Dict[str, float], key: str, template: str, scale: float = 1) -> Optional[str]:
    value = figures.get(f"ds_profutils/{key}")
    return None if value is None else template.format(value * scale)


def _cause_word(code: Optional[float]) -> str:
    """`` (more_work)`` for the straggler's cause code, nothing where none was sent."""
    return "" if not code else f" ({LIVE_CAUSES[int(code) - 1]})"


def _gap_words(figures: Dict[str, float]) -> Optional[str]:
    """``(gap 6.7; eval 80.1 ms, save 35.0 ms in the interval)``: the gap median and, where there were any, the
    interval's eval and checkpoint-save times in it (sums over the steps: what lowered the interval's rates)."""
    parts = ", ".join(filter(None, [_format(figures, "eval_ms", "eval {:.1f} ms"),
                                    _format(figures, "save_ms", "save {:.1f} ms")]))
    words = "; ".join(filter(None, [_format(figures, "gap_ms", "gap {:.1f}"), parts and f"{parts} in the interval"]))
    return f"({words})" if words else None


def console_line(events: Sequence[Event]) -> str:
    """One short line for rank 0's console, the figures it has in the events' order; e.g.
    ``ds_profutils step 40: step 123.4 ms, iteration 130.1 ms (gap 6.7; eval 80.1 ms in the interval),
    12.3 TFLOP/s, MFU 4.1%, 5,120 tok/s, wait 8%, peak 1.2 GiB, straggler rank 1 (compute)``."""
    figures = {name: value for name, value, _ in events}
    iteration = _format(figures, "iteration_ms", "iteration {:.1f} ms")
    gap = _gap_words(figures)
    straggler = figures.get("ds_profutils/straggler_rank")
    slowest = figures.get("ds_profutils/slowest_stage")
    parts = [
        _format(figures, "step_ms", "step {:.1f} ms"),
        " ".join(filter(None, [iteration, gap])) or None,
        flops_rate(figures.get("ds_profutils/tflops")),
        _format(figures, "mfu", "MFU {:.3g}%", scale=100),
        _format(figures, "tokens_per_s", "{:,.0f} tok/s"),
        _format(figures, "exposed_wait_share", "wait {:.0%}"),
        _format(figures, "peak_allocated_gib", "peak {:.1f} GiB"),
        None if straggler is None else "no straggler" if straggler < 0 else f"straggler rank {straggler:.0f}"
        + _cause_word(figures.get("ds_profutils/straggler_cause")),
        _format(figures, "bubble_share", "bubble {:.0%}"),
        None if slowest is None else "no slow stage" if slowest < 0 else f"slowest stage {slowest:.0f}",
    ]
    step = events[0][2] if events else "?"
    return f"ds_profutils step {step}: " + ", ".join(part for part in parts if part)


class ConsoleSink:
    """Prints :func:`console_line` to stdout (rank 0 only, as every sink): the one output of a job that
    reports nowhere else."""

    def write(self, events: List[Event]) -> None:
        print(console_line(events), flush=True)
