"""What a run was set up with, as far as its files say, and which of it differs between two runs.

Sources, all small: the report's own figures per engine (world size, ranks, hosts, clocks, micro
steps per optimizer step, the comms logger); the first record of each engine's lowest rank (the
fields that describe the run rather than the step: record schema, dtype, ZeRO-3's
``stage3_max_live_parameters``, the memory figures' source); and the head of the lowest rank's trace
(torch writes its version keys there: ``cuda_runtime_version``, ``distributedInfo.nccl_version``,
the devices).  DeepSpeed's other settings (a bucket size, say) are not in the files: their effect
shows in the event table (numel per event) instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import orjson

from ..outputs import fetch_records_files, trace_files
from ..report.traces import TraceFormatError, iter_trace

__all__ = ["run_settings", "settings_differences"]

_RECORD_SETTINGS = ("schema", "dtype", "max_live_parameters")
# Trace head keys that name the file, its process or its clock, not the run's set-up.
_TRACE_PER_FILE = frozenset({"baseTimeNanoseconds", "displayTimeUnit", "host_name", "trace_id", "traceName",
                             "distributedInfo.rank", "distributedInfo.pg_config", "distributedInfo.pg_count",
                             "ds_profutils.rank", "ds_profutils.host", "ds_profutils.pid", "ds_profutils.run_id"})


def _first_record(path: Path) -> Optional[Mapping[str, Any]]:
    """The first line of a records file as JSON, or None (unreadable, torn, not an object)."""
    try:
        with open(path, "rb") as source:
            line = source.readline()
        record = orjson.loads(line)
    except (OSError, orjson.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _record_settings(path: Path) -> Dict[str, Any]:
    record = _first_record(path)
    if record is None:
        return {}
    found = {key: record.get(key) for key in _RECORD_SETTINGS}
    found["schema"] = found["schema"] if "schema" in record else "none (an older ds_profutils)"
    memory = record.get("memory")
    found["memory figures"] = memory.get("source") if isinstance(memory, dict) else None
    return found


def _trace_settings(path: Path) -> Dict[str, Any]:
    """The scalar keys of a trace's head (one level of nesting flattened), less those of the file."""
    events = iter_trace(path)
    try:
        _, head = next(events)  # the keys before "traceEvents": nothing else of the file is read
    except (OSError, StopIteration, TraceFormatError):
        return {}
    finally:
        events.close()
    found: Dict[str, Any] = {}
    for key, value in head.items():
        if key == "deviceProperties" and isinstance(value, list):
            found["devices"] = [device.get("name") for device in value if isinstance(device, dict)]
        elif isinstance(value, dict):
            found.update((f"{key}.{inner}", item) for inner, item in value.items()
                         if not isinstance(item, (dict, list)))
        elif not isinstance(value, list):
            found[key] = value
    return {key: value for key, value in found.items() if key not in _TRACE_PER_FILE}


def run_settings(directory: Path, report: Mapping[str, Any]) -> Dict[Optional[str], Dict[str, Any]]:
    """``{scope: {setting: value}}``: per engine (scope: its name) and for the traces (scope ``None``)."""
    records = fetch_records_files(directory)
    settings: Dict[Optional[str], Dict[str, Any]] = {}
    for name, engine in report["engines"].items():
        summary = engine["ranks_summary"]
        optimizer_steps = sum(row["steps"] for row in summary.values())
        files = records.get(name, {})
        settings[name] = {
            "world size": engine["world_size"],
            "ranks with records": len(engine["ranks"]),
            "recording ranks": engine["recording_ranks"],
            "hosts": len({row["host"] for row in summary.values()}),
            "clock": sorted(engine["clocks"]),
            "micro steps per optimizer step": (round(engine["records"].get("train", 0) / optimizer_steps, 2)
                                               if optimizer_steps else None),
            "comms logger on": engine["comms_logger_records"] > 0,
            "model_numel": engine["model_numel"],  # the model's full parameter count, where the records say
            **(_record_settings(files[min(files)]) if files else {}),
        }
    traces = trace_files(directory)
    if traces:
        settings[None] = _trace_settings(traces[min(traces)])
    return settings


def settings_differences(base: Mapping[str, Any], new: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """``[{setting, base, new}]`` for every setting of one scope whose value differs (None: not in that run)."""
    return [{"setting": key, "base": base.get(key), "new": new.get(key)}
            for key in list(base) + [key for key in new if key not in base] if base.get(key) != new.get(key)]
