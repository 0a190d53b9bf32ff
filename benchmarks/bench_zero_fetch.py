"""ZeRO-3 fetch profiling, measured against DeepSpeed in one run.

    python benchmarks/bench_zero_fetch.py [--pairs 20000] [--per-step 250] [--repeats 25] [--step-pairs 300]
                                          [--report-mb 1024] [--trace-mb 56] [--skip-train]
                                          [--hta-python PATH]

(a) ``start_event`` + ``stop_event`` per fetch, as added cost over two empty method calls, with the
    counters reset every ``--per-step`` fetches as DeepSpeed resets them every forward: ours enabled
    against DeepSpeed's profiler with DeepSpeed's ``SynchronizedWallClockTimer`` (target <= 0.5x);
    disabled, whole call against DeepSpeed's disabled one (target <= 1.0x; both add ~0 over empty
    calls, so the ratio of the whole calls is the meaningful one).
(b) Memory over 200k events (tracemalloc), ours and DeepSpeed's: ours must not grow.
(c) A ZeRO-3 training step (2 ranks under the deepspeed launcher, gloo on CPU) with fetch records
    on (``attach`` before two steps, ``close`` after them) against off, interleaved: the median over
    adjacent on/off pairs of the ratio of the second steps' times, per rank (target <= 1.03x).  The
    first step after ``attach`` carries one-off costs a job pays once (garbage from ``attach``, the
    recorder's first record); its ratio is printed too, without a target.
(d) ``ds-profutils report`` on ``--report-mb`` of generated per-rank records (target: 1 GB < 60 s).
(e) The report's trace summary on a generated ``--trace-mb`` Chrome trace, against ``json.load`` of
    the same file (a floor for any loader that parses the trace whole, as HolisticTraceAnalysis does).
    With ``--hta-python PATH`` (an interpreter that can ``import hta``, kept in its own venv, e.g.
    ``python3 -m venv ~/.cache/ds_profutils/hta-venv && ~/.cache/ds_profutils/hta-venv/bin/pip install
    torch==2.13.0 HolisticTraceAnalysis``), also against HolisticTraceAnalysis itself: the trace lies
    alone in a directory as HTA expects (``.json``, rank from ``distributedInfo``), and a fresh
    subprocess each runs our ``summarize_trace`` and HTA's ``TraceAnalysis(trace_dir=...)`` (which
    loads and parses it into a DataFrame per rank). Wall time of the call, and the process's peak RSS,
    whole and added over its imports (target: HTA's time >= 5x ours, our peak <= HTA's).

Micro figures are medians of interleaved repeats, so a noisy neighbour hits all sides alike.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler as DeepSpeedProfiler
from deepspeed.utils.timer import SynchronizedWallClockTimer

from ds_profutils.outputs import fetch_records_file
from ds_profutils.report import build_report, render_text
from ds_profutils.zero3 import NUMEL_UNITS, PartitionedParameterProfiler
from ds_profutils.report.traces import summarize_trace

REPO = Path(__file__).resolve().parent.parent
ENABLED_TARGET, DISABLED_TARGET, STEP_TARGET, REPORT_SECONDS_PER_GB = 0.5, 1.0, 1.03, 60.0
HTA_TIME_TARGET, HTA_MEMORY_TARGET = 5.0, 1.0
EVENT = "forward_fetch_wait"


class EmptyCalls:
    """The floor: two method calls that do nothing."""

    def start_event(self, name: str) -> None:
        pass

    def stop_event(self, name: str, num_elem: int) -> None:
        pass

    def reset_events(self) -> None:
        pass


def fresh(profiler: Any) -> None:
    """Between repeats: DeepSpeed's timers keep one record per event until logged; start each repeat empty."""
    profiler.reset_events()
    for timer in getattr(getattr(profiler, "timers", None), "timers", {}).values():
        timer.reset()


def per_step_seconds(profiler: Any, pairs: int, per_step: int) -> float:
    """``pairs`` start+stop pairs, counters reset every ``per_step`` as DeepSpeed resets them every forward."""
    began = time.perf_counter()
    for _ in range(pairs // per_step):
        profiler.reset_events()
        for _ in range(per_step):
            profiler.start_event(EVENT)
            profiler.stop_event(EVENT, 4096)
    return time.perf_counter() - began


def bench_hot_path(pairs: int, repeats: int, per_step: int) -> Dict[str, float]:
    candidates = {
        "two empty method calls": EmptyCalls(),
        "deepspeed, enabled": DeepSpeedProfiler(SynchronizedWallClockTimer()),
        "ds_profutils, enabled": PartitionedParameterProfiler(SynchronizedWallClockTimer(), element_size=2),
        "deepspeed, disabled": DeepSpeedProfiler(None),
        "ds_profutils, disabled": PartitionedParameterProfiler(None),
    }
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    gc.disable()
    try:
        for _ in range(repeats):
            for name, profiler in candidates.items():
                if name != "two empty method calls":
                    fresh(profiler)
                samples[name].append(per_step_seconds(profiler, pairs, per_step) / pairs * 1e9)
    finally:
        gc.enable()
    ns = {name: statistics.median(values) for name, values in samples.items()}
    floor = ns["two empty method calls"]
    print(f"(a) start_event + stop_event, ns per pair (median of {repeats} interleaved repeats of {pairs:,}; counters "
          f"reset every {per_step} pairs, as every forward resets them)")
    for name, value in ns.items():
        print(f"    {name:26s} {value:8.1f} ns   added over empty calls {value - floor:8.1f} ns")
    enabled = (ns["ds_profutils, enabled"] - floor) / (ns["deepspeed, enabled"] - floor)
    disabled = ns["ds_profutils, disabled"] / ns["deepspeed, disabled"]
    print(f"    enabled, added cost vs DeepSpeed's     {enabled:6.2f}x  (target <= {ENABLED_TARGET}x)")
    print(f"    disabled, whole call vs DeepSpeed's    {disabled:6.2f}x  (target <= {DISABLED_TARGET}x)")
    return {"enabled_ratio": enabled, "disabled_ratio": disabled}


def memory_growth(profiler: Any, events: int) -> Dict[str, int]:
    """Bytes traced after 10% of ``events`` start+stop pairs and after all, never logging in between."""
    profiler.start_event(EVENT)
    profiler.stop_event(EVENT, 1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = {}
    for done in range(1, events + 1):
        profiler.start_event(EVENT)
        profiler.stop_event(EVENT, 4096)
        if done == events // 10:
            result["after 10%"] = tracemalloc.get_traced_memory()[0] - base
    result["after all"] = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return result


def bench_memory(events: int) -> None:
    print(f"(b) memory traced over {events:,} events (bytes)")
    for name, profiler in (("deepspeed", DeepSpeedProfiler(SynchronizedWallClockTimer())),
                           ("ds_profutils", PartitionedParameterProfiler(SynchronizedWallClockTimer()))):
        growth = memory_growth(profiler, events)
        print(f"    {name:14s} after 10%: {growth['after 10%']:>10,}   after all: {growth['after all']:>10,}")


# ---------------------------------------------------------------------------------------------------
# (c) a ZeRO-3 training step, on vs off; the part below --worker runs on each rank under the launcher
# ---------------------------------------------------------------------------------------------------


def worker(out: Path, pairs: int) -> None:
    import deepspeed
    import torch

    from ds_profutils import attach

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(12)])
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "partitioned_param_profiler": {"enabled": True, "output_dir": str(out / "records")},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = torch.randn(8, 128)

    def step() -> float:
        began = time.perf_counter()
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
        return time.perf_counter() - began

    for _ in range(5):
        step()
    seconds: Dict[str, List[float]] = {"off": [], "on": []}
    first_steps: Dict[str, List[float]] = {"off": [], "on": []}
    for pair in range(pairs):
        for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
            recorder = attach(engine) if mode == "on" else None  # attach and close are not timed
            # The first step pays what a job pays once per attach, not per step: collecting the garbage
            # attach leaves, the recorder's first counters and write.  Timed apart; the second is the
            # per-step cost.
            first_steps[mode].append(step())
            seconds[mode].append(step())
            if recorder is not None:
                recorder.close()
    last_record = fetch_records_file(out / "records", rank).read_text().splitlines()[-1]
    events = sum(event["count"] for event in json.loads(last_record)["events"].values())
    (out / f"rank_{rank}.json").write_text(
        json.dumps({"seconds": seconds, "first_steps": first_steps, "events_per_step": events}))


def bench_training_step(pairs: int) -> float:
    sys.path.insert(0, str(REPO / "tests"))
    from launcher import run_deepspeed

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run_deepspeed(Path(__file__), ["--worker", str(out), "--step-pairs", str(pairs)], timeout=900)
        results = {rank: json.loads((out / f"rank_{rank}.json").read_text()) for rank in (0, 1)}
    print(f"(c) ZeRO-3 training step, 2 ranks, {pairs} interleaved on/off step pairs")
    worst = 0.0
    for rank, result in results.items():
        off, on = result["seconds"]["off"], result["seconds"]["on"]
        # on/off compared within each pair of adjacent steps, so load from a neighbour that comes and
        # goes hits both sides of a pair alike.
        ratio = statistics.median(b / a for a, b in zip(off, on))
        first = statistics.median(b / a for a, b in zip(result["first_steps"]["off"], result["first_steps"]["on"]))
        worst = max(worst, ratio)
        print(f"    rank {rank}: off {statistics.median(off) * 1e3:7.2f} ms   on {statistics.median(on) * 1e3:7.2f} ms"
              f"   ratio {ratio:5.3f}x   ({result['events_per_step']} fetch events per step; "
              f"first step after attach {first:5.3f}x)")
    print(f"    worst rank ratio {worst:5.3f}x  (target <= {STEP_TARGET}x)")
    return worst


# ---------------------------------------------------------------------------------------------------
# (d) the report on generated records, (e) the trace summary
# ---------------------------------------------------------------------------------------------------


def generate_records(directory: Path, megabytes: int, ranks: int = 8) -> int:
    """Per-rank JSONL like attach writes (all eight events per step); returns the bytes written."""
    rng = random.Random(0)
    per_rank = megabytes * 2**20 // ranks
    written = 0
    for rank in range(ranks):
        variants = []
        for _ in range(64):
            events = {}
            for name, unit in NUMEL_UNITS.items():
                count, times = rng.randint(1, 40), sorted(rng.uniform(0.001, 5.0) for _ in range(3))
                numel = rng.randint(1, 10**7)
                events[name] = {"count": count, "numel": numel, "numel_unit": unit, "bytes": 2 * numel,
                                "time_ms": times[2] * count / 2, "min_ms": times[0], "max_ms": times[2],
                                "p50_ms": times[1], "p95_ms": times[2]}
            variants.append(json.dumps(events, separators=(",", ":")))
        size, step = 0, 0
        with open(fetch_records_file(directory, rank), "w") as out:
            while size < per_rank:
                lines = "".join(f'{{"step":{s},"global_step":{s},"mode":"train","time":1700000000.{s},"rank":{rank},'
                                f'"world_size":{ranks},"host":"node-{rank // 4}","dtype":"bfloat16",'
                                f'"step_time_ms":{250 + s % 17}.5,"events":{variants[s % 64]}}}\n'
                                for s in range(step, step + 1000))
                out.write(lines)
                size += len(lines)
                step += 1000
        written += size
    return written


def bench_report(megabytes: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        size = generate_records(directory, megabytes)
        began = time.perf_counter()
        text = render_text(build_report(directory))
        seconds = time.perf_counter() - began
    gigabytes = size / 2**30
    print(f"(d) report on {size / 2**20:,.0f} MB of records ({text.count(chr(10)) + 1} lines of output): "
          f"{seconds:.1f} s, {size / 2**20 / seconds:.0f} MB/s -> {seconds / gigabytes:.1f} s per GB "
          f"(target < {REPORT_SECONDS_PER_GB:.0f} s per GB)")
    return seconds / gigabytes


def generate_trace(path: Path, megabytes: int) -> None:
    """A torch-like Chrome trace: steps, nested CPU ops with args, one event per line."""
    rng = random.Random(0)
    names = [f"aten::op_{i}" for i in range(300)]
    with open(path, "w") as out:
        out.write('{"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 2}, '
                  '"traceEvents": [\n')
        ts, step, first = 0, 0, True
        while out.tell() < megabytes * 2**20:
            events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": ts, "dur": 50_000.0}]
            for _ in range(2000):
                events.append({"ph": "X", "cat": "cpu_op", "name": rng.choice(names), "pid": 1, "tid": 1,
                               "ts": ts + rng.randint(0, 50_000), "dur": rng.uniform(1, 500),
                               "args": {"External id": rng.randint(1, 10**6), "Record function id": 0,
                                        "Ev Idx": rng.randint(1, 10**6), "Input Dims": [[8, 128], [128, 128]]}})
            out.write(("" if first else ",\n") + ",\n".join(json.dumps(e) for e in events))
            first, ts, step = False, ts + 50_000, step + 1
        out.write('\n], "traceName": "bench"}\n')


def timed_and_peak(fn: Callable[[], Any]) -> Dict[str, float]:
    began = time.perf_counter()
    fn()
    seconds = time.perf_counter() - began
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": seconds, "peak_mb": peak / 2**20}


# Each runs in a fresh interpreter: argv[1] is the trace (ours) or its directory (HTA); the last line
# printed is JSON. Peak RSS is the process's high-water mark, VmHWM, read once after the imports and
# once after the call, so the part the call itself added can be told from the imports. Not ru_maxrss:
# Linux carries it over fork and exec, so each child would start at this (torch-importing) process's peak.
_CHILD_PRELUDE = """
import json, sys, time
def peak_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
"""
OURS_CHILD = _CHILD_PRELUDE + """
from ds_profutils.report.traces import summarize_trace
imported_mb = peak_mb()
began = time.perf_counter()
summary = summarize_trace(sys.argv[1])
seconds = time.perf_counter() - began
print(json.dumps({"seconds": seconds, "imported_mb": imported_mb, "peak_mb": peak_mb(), "rank": summary["rank"],
                  "events": summary["events"], "steps": len(summary["steps"])}))
"""
HTA_CHILD = _CHILD_PRELUDE + """
from hta.trace_analysis import TraceAnalysis
imported_mb = peak_mb()
began = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
seconds = time.perf_counter() - began
print(json.dumps({"seconds": seconds, "imported_mb": imported_mb, "peak_mb": peak_mb(),
                  "rows": {str(rank): len(frame) for rank, frame in analysis.t.traces.items()},
                  "files": {str(rank): path for rank, path in analysis.t.trace_files.items()}}))
"""


def run_child(python: str, code: str, target: Path, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    began = time.perf_counter()
    done = subprocess.run([python, "-c", code, str(target)], capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - began
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{python} failed on {target} (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return dict(json.loads(lines[-1]), wall=wall)


def bench_against_hta(hta_python: str, trace: Path) -> None:
    """Ours and HTA's load of ``trace`` (alone in its directory), each in a fresh subprocess."""
    package_root = str(Path(sys.modules["ds_profutils"].__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    ours = run_child(sys.executable, OURS_CHILD, trace, env)
    hta = run_child(hta_python, HTA_CHILD, trace.parent)
    # HTA logs and skips what it cannot use; make sure it found this file as rank 0 and parsed events from it.
    if (list(hta["files"]) != ["0"] or Path(hta["files"]["0"]).resolve() != trace.resolve()
            or hta["rows"].get("0", 0) <= 0):
        raise SystemExit(f"HTA did not parse {trace} as rank 0: files {hta['files']}, rows {hta['rows']}")
    if ours["rank"] != 0 or ours["events"] <= 0:
        raise SystemExit(f"our summary of {trace} found rank {ours['rank']}, {ours['events']} events")
    time_ratio = hta["seconds"] / ours["seconds"]
    memory_ratio = ours["peak_mb"] / hta["peak_mb"]
    added_ratio = (ours["peak_mb"] - ours["imported_mb"]) / max(hta["peak_mb"] - hta["imported_mb"], 1e-9)
    print(f"    against HolisticTraceAnalysis ({hta_python}), each in a fresh subprocess:")
    rows = (("ds_profutils summarize_trace", ours, f"{ours['events']:,} events, {ours['steps']} steps"),
            ("HTA TraceAnalysis(trace_dir)", hta, f"{hta['rows']['0']:,} DataFrame rows for rank 0"))
    for name, result, what in rows:
        print(f"    {name:29s} {result['seconds']:6.2f} s (process {result['wall']:6.2f} s)   peak RSS "
              f"{result['peak_mb']:6.0f} MB ({result['imported_mb']:4.0f} MB after imports, "
              f"+{result['peak_mb'] - result['imported_mb']:4.0f} MB by the call)   {what}")
    print(f"    HTA time / ours             {time_ratio:6.2f}x  (target >= {HTA_TIME_TARGET}x)")
    print(f"    our peak RSS / HTA's        {memory_ratio:6.2f}x  (target <= {HTA_MEMORY_TARGET}x; "
          f"added by the call alone: {added_ratio:.2f}x)")


def bench_trace_summary(megabytes: int, hta_python: Optional[str] = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # The trace alone in its directory, as HTA's TraceAnalysis(trace_dir=...) reads every .json there.
        path = Path(tmp) / "trace_rank_0.json"
        generate_trace(path, megabytes)
        size = path.stat().st_size / 2**20
        ours = timed_and_peak(lambda: summarize_trace(path))
        whole = timed_and_peak(lambda: json.loads(path.read_text()))
        print(f"(e) trace summary of a {size:.0f} MB trace: {ours['seconds']:.2f} s, peak {ours['peak_mb']:.1f} MB; "
              f"json.load alone: {whole['seconds']:.2f} s, peak {whole['peak_mb']:.0f} MB "
              f"({whole['seconds'] / ours['seconds']:.1f}x our time, "
              f"{whole['peak_mb'] / ours['peak_mb']:.0f}x our memory)")
        if hta_python is None:
            print("    against HolisticTraceAnalysis: not measured; pass --hta-python PATH, an interpreter that can "
                  "import hta (its own venv: pip install torch==2.13.0 HolisticTraceAnalysis)")
        else:
            bench_against_hta(hta_python, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--per-step", type=int, default=250,
                        help="(a) fetches of one event per forward (a 24-layer transformer fetches ~240 submodules)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--memory-events", type=int, default=200_000)
    parser.add_argument("--step-pairs", type=int, default=300, help="(c) interleaved on/off training steps")
    parser.add_argument("--skip-train", action="store_true", help="skip (c), the launcher run")
    parser.add_argument("--report-mb", type=int, default=1024, help="(d) size of the generated records")
    parser.add_argument("--trace-mb", type=int, default=56, help="(e) size of the generated trace")
    parser.add_argument("--hta-python", metavar="PATH",
                        help="(e) also compare against HolisticTraceAnalysis, run by this interpreter (its own venv)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.step_pairs)
        return
    bench_hot_path(args.pairs, args.repeats, args.per_step)
    bench_memory(args.memory_events)
    if not args.skip_train:
        bench_training_step(args.step_pairs)
    bench_report(args.report_mb)
    bench_trace_summary(args.trace_mb, args.hta_python)


if __name__ == "__main__":
    main()
