"""Bounded statistics of a stream of durations, shared by the timer and the ZeRO-3 fetch profiler.

Both sit on hot paths (every timed region, every ZeRO-3 fetch) and may run for a whole job between
two reads, so they keep exact count, total, min and max and one bounded random sample for trimmed
means and percentiles, in constant memory.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, List, Optional, Sequence, Tuple

import numpy

from .exceptions import InvalidArgumentError

__all__ = ["FOLD_EVERY", "MEAN_TRIM", "SAMPLE_SIZE", "DurationStats", "trim_mean"]

SAMPLE_SIZE = 4096
"""Durations a :class:`DurationStats` keeps: every one up to this many, a uniform random sample beyond."""
FOLD_EVERY = 1024
"""Durations (or device event pairs) held before they are folded into the statistics."""
MEAN_TRIM = 0.1
"""Share of durations trimmed from each end by a timer's ``mean()``, as in DeepSpeed."""


def _trim_count(n: int, trim_percent: float) -> int:
    """How many values DeepSpeed's ``trim_mean`` drops from each end of ``n`` values."""
    return int(round(n * trim_percent))


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean of ``data`` without the ``trim_percent`` smallest and largest values (DeepSpeed's rule).

    ``round(len(data) * trim_percent)`` values go from each end; an empty ``data`` gives 0, and a trim
    that leaves nothing gives NaN (as numpy's mean of nothing).  ``data`` is not reordered: the comms
    logger passes lists whose positions correspond across latency and bandwidth.
    """
    if not 0.0 <= trim_percent <= 1.0:
        raise InvalidArgumentError(f"trim_mean: trim_percent must be within [0, 1], got {trim_percent!r}")
    n = len(data)
    if n == 0:
        return 0
    k = _trim_count(n, trim_percent)
    kept = sorted(data)[k:n - k]
    return sum(kept) / len(kept) if kept else float("nan")


class DurationStats:
    """Exact count, total, min and max of a stream of durations, and a bounded uniform random sample.

    The sample holds every duration up to ``size`` of them, then is a reservoir (Algorithm R: the
    duration arriving as the i-th replaces a random slot with chance size/i), so each duration is
    equally likely to be in it.  Random rather than every n-th duration: a stream with a period (8
    layers' fetches repeating, gradient-accumulation micro steps) would alias with a stride, keeping
    only the slow or only the fast ones.  Seeded by name, so a run repeats exactly while different
    streams keep different positions.

    Cost, which sits on hot paths: a duration is appended to ``pending`` (``add`` does the same) and
    batches of ``FOLD_EVERY`` are folded in.  While the sample fills, folding is a list extend and the
    figures are read off the sample when asked; beyond, each batch's totals are added and the
    reservoir's replacements drawn with numpy.  (Figures per duration in Python cost 1.6x DeepSpeed's
    whole timer ``stop()``; converting the sample to numpy when it fills cost ~50 ns per duration of a
    5000-duration stream: ``benchmarks/bench_timer.py``.)
    """

    __slots__ = ("pending", "size", "_count", "_sample", "_first", "_beyond", "_random", "_seed")

    def __init__(self, seed: str = "", size: int = SAMPLE_SIZE) -> None:
        self.size = size
        self._seed = seed
        self.pending: List[float] = []
        self._random: Optional[numpy.random.Generator] = None  # made when a sample first fills
        self._count = 1  # so that reset() sets everything
        self.reset()

    def reset(self) -> None:
        """Forget every duration (``pending`` stays the same list, so hot paths may hold it)."""
        self.pending.clear()
        if not self._count:  # nothing folded in since the last reset (the fetch profiler resets every forward)
            return
        self._count = 0  # durations folded in
        self._sample: List[float] = []
        self._first: Any = None  # once the sample filled: its first ``size`` durations, or their figures
        self._beyond: List[float] = [0, math.inf, -math.inf]  # total, min, max of the durations after those

    def add(self, duration: float) -> None:
        """Count one duration."""
        self.pending.append(duration)
        if len(self.pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Move the pending durations into the figures and the sample."""
        if not self.pending:
            return
        batch = self.pending[:]
        self.pending.clear()
        first_arrival = self._count + 1
        self._count += len(batch)
        room = self.size - len(self._sample)
        if room > 0:  # filling: the sample is every duration so far
            self._sample.extend(batch[:room])
            if len(self._sample) < self.size:
                return
            self._first = self._sample[:]  # their figures are added when first read
            self._random = self._random or numpy.random.default_rng(zlib.crc32(self._seed.encode()))
            batch, first_arrival = batch[room:], first_arrival + room
            if not batch:
                return
        beyond = self._beyond
        beyond[:] = beyond[0] + sum(batch), min(beyond[1], min(batch)), max(beyond[2], max(batch))
        arrivals = numpy.arange(first_arrival, first_arrival + len(batch), dtype=numpy.float64)
        kept = numpy.flatnonzero(self._random.random(len(batch)) * arrivals < self.size).tolist()
        for position, slot in zip(kept, self._random.integers(0, self.size, size=len(kept)).tolist()):
            self._sample[slot] = batch[position]

    def figures(self) -> Tuple[float, Optional[float], Optional[float]]:
        """(total, min, max) of every duration; min and max are None before any."""
        self.fold()
        if self._count <= self.size:  # the sample holds them all
            return sum(self._sample), min(self._sample, default=None), max(self._sample, default=None)
        if isinstance(self._first, list):
            self._first = sum(self._first), min(self._first), max(self._first)
        (total, low, high), beyond = self._first, self._beyond
        return total + beyond[0], min(low, beyond[1]), max(high, beyond[2])

    @property
    def count(self) -> int:
        """Durations added."""
        return self._count + len(self.pending)

    @property
    def total(self) -> float:
        """Their exact sum: the pending durations' alone while nothing was folded in since the last reset
        (a timer the engine reads and resets every step), which leaves them pending."""
        if not self._count:
            return sum(self.pending)
        return self.figures()[0]

    @property
    def min(self) -> Optional[float]:
        """The shortest (None before any)."""
        return self.figures()[1]

    @property
    def max(self) -> Optional[float]:
        """The longest (None before any)."""
        return self.figures()[2]

    @property
    def sample(self) -> List[float]:
        """Every duration up to ``size`` of them; beyond, a uniform random ``size`` of them."""
        self.fold()
        return self._sample

    def percentiles(self, *percents: float) -> List[Optional[float]]:
        """Nearest-rank percentiles of the sample (sorted once); None for each before any duration."""
        ordered = sorted(self.sample)
        return [ordered[max(0, math.ceil(len(ordered) * percent / 100) - 1)] if ordered else None
                for percent in percents]

    def trimmed_mean(self, trim_percent: float = MEAN_TRIM) -> float:
        """DeepSpeed's ``trim_mean`` of the durations: exact while the sample holds them all.

        Beyond, the exact total less the two trimmed tails, each estimated as its count times the mean
        of the same tail of the sample.  Only the tails are estimated, so a stream that mixes fast and
        slow durations is not at the mercy of the sample's mix of them.
        """
        ordered, n = sorted(self.sample), self.count
        if n == len(ordered):
            return float(trim_mean(ordered, trim_percent))  # (0 for no durations, as DeepSpeed)
        trimmed, tail = _trim_count(n, trim_percent), _trim_count(len(ordered), trim_percent)
        if tail == 0:
            return self.total / n
        tails = sum(ordered[:tail]) + sum(ordered[len(ordered) - tail:])
        return (self.total - trimmed * tails / tail) / (n - 2 * trimmed)
