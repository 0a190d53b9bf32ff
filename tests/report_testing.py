"""Records (schema 2) and traces as ds_profutils writes them, generated for the report's tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional


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
               engine: str = "main", noise_ms: float = 0.5) -> None:
    """A run in which ``slowed`` spends ``slow_ms`` more per step outside the collectives (None: no rank
    slowed): every other rank waits that long in the gradient collective, the slowed one does not."""
    for rank in range(ranks):
        rows: List[Dict[str, Any]] = []
        for step in range(steps):
            jitter = noise_ms * ((rank * 7 + step * 3) % 5 - 2) / 2  # deterministic, +-noise_ms
            waits_for_peer = slowed is not None and rank != slowed
            rows.append(record(rank, step, busy_ms=20.0 + (slow_ms if rank == slowed else 0.0),
                               collective_ms=2.0 + jitter + (slow_ms if waits_for_peer else 0.0),
                               world_size=ranks, engine=engine, host=f"node-{rank // 2}"))
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
