"""Records (schema 2, and schema 3 by :func:`schema3`) and traces as ds_profutils writes them, generated for
the report's tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional


def event(count: int, numel: int, time_ms: float, unit: str = "shard", element_size: int = 4) -> Dict[str, Any]:
    return {"count": count, "numel": numel, "numel_unit": unit, "bytes": numel * element_size, "time_ms": time_ms,
            "min_ms": time_ms / count, "max_ms": time_ms / count, "p50_ms": time_ms / count,
            "p95_ms": time_ms / count, "dropped": 0, "clock": "host"}


def record(rank: int, global_step: int, *, busy_ms: float = 20.0, fetch_ms: float = 1.0, collective_ms: float = 2.0,
           mode: str = "train", engine: str = "main", world_size: int = 2, host: str = "node-a",
           micro_step: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
    """One forward's record: the step takes busy + fetch wait + blocking-collective wait."""
    return {
        "schema": 2, "engine": engine, "rank": rank, "world_size": world_size, "local_rank": rank % 2, "host": host,
        "pid": 4000 + rank, "recording_ranks": None, "dtype": "float32", "mode": mode, "global_step": global_step,
        "micro_step": global_step if micro_step is None else micro_step, "time": 1790000000.0 + global_step,
        "clock": "host", "step_time_ms": busy_ms + fetch_ms + collective_ms, "fetch_wait_ms": fetch_ms,
        "collective_wait_ms": collective_ms, "exposed_wait_ms": fetch_ms + collective_ms,
        "collectives": {"reduce_scatter_tensor": {"count": 1, "time_ms": collective_ms}}, "comms_logger": False,
        "events": {"forward_fetch_wait": event(4, 800, fetch_ms / 2), "backward_fetch_wait": event(4, 800, fetch_ms / 2),
                   "forward_all_gather": event(3, 1600, 1.5 + rank, unit="full")},
        **extra,
    }


def schema3(base: Dict[str, Any], *, inside_ms: Optional[float] = None, peak_bytes: Optional[int] = None,
            reserved_bytes: Optional[int] = None, source: str = "allocator", live_params: Optional[int] = 5000,
            max_live: int = 1_000_000_000, invalidations: int = 0, hits: int = 6, waited: int = 2) -> Dict[str, Any]:
    """``base`` (a :func:`record`) as schema 3 writes it: the time inside collectives (``inside_ms``; default
    its blocking wait, as on gloo), the collectives per schema 3, and memory figures when ``peak_bytes`` is
    given (reserved: 25% more unless said; phases: the step's peak in backward)."""
    waited_ms = base["collective_wait_ms"]
    inside = waited_ms if inside_ms is None else inside_ms
    out = dict(base, schema=3, collective_ms=inside, max_live_parameters=max_live,
               trace_cache_invalidations=invalidations, prefetch={"hits": hits, "waited": waited},
               collectives={"reduce_scatter_tensor": {"count": 1, "time_ms": inside, "exposed_ms": waited_ms,
                                                      "stream": "compute", "async": 0, "clock": "host"}})
    if live_params is not None:
        out["live_params_max"] = live_params
    if peak_bytes is not None:
        out["memory"] = {"source": source, "peak_allocated_bytes": peak_bytes,
                         "peak_reserved_bytes": peak_bytes * 5 // 4 if reserved_bytes is None else reserved_bytes,
                         "phases": {"forward": peak_bytes * 3 // 4, "backward": peak_bytes, "step": peak_bytes // 2}}
    return out


def read_records_file(path: Path) -> List[Dict[str, Any]]:
    """The records of one file as a user's script reads them, every line whole (a torn line fails)."""
    text = path.read_text()
    assert text.endswith("\n") or not text, f"{path} ends in a torn line"
    return [json.loads(line) for line in text.splitlines()]


def records_file(directory: Path, rank: int, engine: str = "main") -> Path:
    return directory / (f"zero_fetch_rank_{rank}.jsonl" if engine == "main" else f"zero_fetch_{engine}_rank_{rank}.jsonl")


def write_records(directory: Path, rank: int, records: Iterable[Dict[str, Any]], *, engine: str = "main",
                  tail: str = "") -> Path:
    path = records_file(directory, rank, engine)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def slowed_run(directory: Path, ranks: int, steps: int, slowed: Optional[int], *, slow_ms: float = 30.0,
               engine: str = "main", noise_ms: float = 0.5, overlapped: bool = False) -> None:
    """A run in which ``slowed`` spends ``slow_ms`` more per step outside the collectives (None: no rank
    slowed): every other rank waits that long in the gradient collective, the slowed one does not.

    ``overlapped``: schema 3 records of collectives on a side stream (ZeRO-3's ``overlap_comm``), as a GPU
    job writes them: the others' wait is inside the collective (``collective_ms``), but no blocking call
    stalls, so it lands in their step time and none of it in their exposed wait."""
    for rank in range(ranks):
        rows: List[Dict[str, Any]] = []
        for step in range(steps):
            jitter = noise_ms * ((rank * 7 + step * 3) % 5 - 2) / 2  # deterministic, +-noise_ms
            waited = slow_ms if slowed is not None and rank != slowed else 0.0
            busy = 20.0 + (slow_ms if rank == slowed else 0.0)
            if overlapped:
                row = record(rank, step, busy_ms=busy + waited, collective_ms=2.0, world_size=ranks, engine=engine,
                             host=f"node-{rank // 2}")
                rows.append(schema3(row, inside_ms=2.0 + jitter + waited))
            else:
                rows.append(record(rank, step, busy_ms=busy, collective_ms=2.0 + jitter + waited, world_size=ranks,
                                   engine=engine, host=f"node-{rank // 2}"))
        write_records(directory, rank, rows, engine=engine)


def write_trace(path: Path, steps: Dict[int, float], *, rank: int = 0, world_size: int = 2,
                step_numbering: Optional[str] = "global", header_first: bool = True,
                profiled_ranks: Any = None) -> None:
    """A torch-like trace whose ``ProfilerStep#N`` ranges last ``steps[N]`` ms, with ds_profutils metadata."""
    events = []
    ts = 0.0
    for number, ms in steps.items():
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "ts": ts,
                       "dur": ms * 1000})
        # On a GPU torch draws the step on the device timeline too; it is not another step.
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{number}", "ts": ts + 10,
                       "dur": 7.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 250.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": ts, "dur": 50.0})
        events.append({"ph": "i", "name": "instant", "ts": ts})
        ts += ms * 1000 + 100
    metadata: Dict[str, Any] = {"host": f"node-{rank // 2}", "rank": rank, "world_size": world_size, "pid": 1}
    if step_numbering is not None:
        metadata["step_numbering"] = step_numbering
        metadata["profiled_ranks"] = profiled_ranks
    head = {"distributedInfo": {"rank": rank, "world_size": world_size}, "ds_profutils": metadata,
            "baseTimeNanoseconds": 1790000000000000000}
    header = json.dumps(head)[1:-1]
    body = '"traceEvents": [\n' + ",\n".join(json.dumps(e) for e in events) + "\n]"
    path.write_text("{" + (f"{header}, {body}" if header_first else f"{body}, {header}") + "}\n")


def memory_run(directory: Path, ranks: int, steps: int, peak: Callable[[int, int], int], *, engine: str = "main",
               **figures: Any) -> None:
    """Schema 3 records of ``ranks`` x ``steps`` whose step peak (allocated bytes) is ``peak(rank, step)``;
    ``figures``: the other :func:`schema3` arguments."""
    for rank in range(ranks):
        write_records(directory, rank, [schema3(record(rank, step, world_size=ranks, engine=engine,
                                                       host=f"node-{rank // 2}"), peak_bytes=peak(rank, step),
                                                **figures) for step in range(steps)], engine=engine)


def iteration_record(rank: int, step: int, *, micro_steps: int = 1, busy_ms: float = 20.0, gap_ms: float = 5.0,
                     tokens: Optional[int] = 512,
                     flops: Optional[float] = 3e12, peak_tflops: Optional[float] = 100.0, model_numel: int = 1_000_000,
                     **extra: Any) -> List[Dict[str, Any]]:
    """The records of one optimizer step of ``micro_steps`` micro steps as a step_metrics writer lays them out:
    ``flops``, ``tokens``, ``samples`` and ``model_numel`` on each, ``iteration_ms`` and ``gap_ms`` on the last
    (the micro step that ended with engine.step()), null on the others."""
    rows = []
    for micro in range(micro_steps):
        last = micro == micro_steps - 1
        row = record(rank, step, busy_ms=busy_ms, micro_step=step * micro_steps + micro, flops=flops, tokens=tokens,
                     samples=4, model_numel=model_numel, peak_tflops=peak_tflops, **extra)
        step_ms = row["step_time_ms"]
        row["iteration_ms"] = micro_steps * step_ms + gap_ms if last else None
        row["gap_ms"] = gap_ms if last else None
        rows.append(row)
    return rows
