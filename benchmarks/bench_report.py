"""``ds-profutils report`` and ``timeline`` at scale, and the command line's start, measured in one run.

    python benchmarks/bench_report.py [--gb 1.0] [--ranks 1024] [--steps 1000] [--skip-big]
                                      [--trace-mb 56] [--hta-python PATH]

Records are generated as attach writes them (record schema 3: eight events with every field, the
collectives with their exposed part and stream, the time inside collectives, memory peaks per phase,
live parameters, trace-cache invalidations and prefetch hits, device clock), about 3 KB a line.  Every command runs in a fresh process,
as a user runs it, stdout to /dev/null.

(a) ``ds-profutils report`` on ``--gb`` of records (64 ranks): seconds per GB (target <= 10 s).
(b) ``--ranks`` x ``--steps`` (1024 x 1000): the disk such a job's records take, and the report's
    time and peak memory, text and ``--json``: the process's peak RSS (VmHWM) and the largest of the
    reader processes it forks.  Memory is bounded by 21 numbers per rank and step (10 columns read per
    rank, 11 in the joined view) plus one record per reader, not by the size of the records; ``--json``
    adds its output.
(c) Start to finish on a small run (2 ranks x 10 steps): ``report``, ``report --json``, ``timeline``
    and ``check-config``, median of 7 (target <= 0.5 s), and which heavy modules they import (none).
(d) The report's trace summary on a generated ``--trace-mb`` Chrome trace, against ``json.load`` of
    the same file (a floor for any loader that parses the trace whole, as HolisticTraceAnalysis does).
    With ``--hta-python PATH`` (an interpreter that can ``import hta``, kept in its own venv, e.g.
    ``python3 -m venv ~/.cache/ds_profutils/hta-venv && ~/.cache/ds_profutils/hta-venv/bin/pip install
    torch==2.13.0 HolisticTraceAnalysis``), also against HolisticTraceAnalysis itself: the trace lies
    alone in a directory as HTA expects (``.json``, rank from ``distributedInfo``), and a fresh
    subprocess each runs our ``summarize_trace`` and HTA's ``TraceAnalysis(trace_dir=...)`` (which
    loads and parses it into a DataFrame per rank). Wall time of the call, and the process's peak RSS,
    whole and added over its imports (target: HTA's time >= 5x ours, our peak <= HTA's).
(e) ``ds-profutils timeline`` merging two ranks' copies of that trace (one on another host): MB/s and
    peak RSS, which stays flat whatever the traces' size (one event in memory at a time).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ds_profutils.report.traces import summarize_trace  # noqa: E402

SECONDS_PER_GB_TARGET, START_TARGET = 10.0, 0.5
HTA_TIME_TARGET, HTA_MEMORY_TARGET = 5.0, 1.0
EVENTS = {"forward_fetch_submit": "shard", "forward_fetch_wait": "shard", "backward_fetch_submit": "shard",
          "backward_fetch_wait": "shard", "forward_prefetch_submit": "full", "backward_prefetch_submit": "full",
          "forward_all_gather": "full", "backward_all_gather": "full"}
HEAVY = ("torch", "deepspeed", "pydantic", "numpy")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

# ---------------------------------------------------------------------------------------------------
# records as attach writes them
# ---------------------------------------------------------------------------------------------------


def _variants(rng: random.Random, count: int = 64) -> List[str]:
    """Serialized ``events`` + ``collectives`` tails of records, reused so generating stays fast."""
    variants = []
    for _ in range(count):
        events = {}
        for name, unit in EVENTS.items():
            calls, times = rng.randint(1, 40), sorted(rng.uniform(0.001, 5.0) for _ in range(3))
            numel = rng.randint(1, 10**7)
            events[name] = {"count": calls, "numel": numel, "numel_unit": unit, "bytes": 2 * numel,
                            "time_ms": times[2] * calls / 2, "min_ms": times[0], "max_ms": times[2],
                            "p50_ms": times[1], "p95_ms": times[2], "dropped": 0,
                            "clock": "device" if name.endswith("_wait") else "host"}
            if name.endswith("_wait"):
                events[name]["host_time_ms"] = times[1] * calls
        scatter, reduce = rng.uniform(1, 20), rng.uniform(0.1, 2)
        collectives = {"reduce_scatter_tensor@side-stream": {"count": 2, "time_ms": scatter, "exposed_ms": 0.0,
                                                             "stream": "side", "async": 2, "clock": "device"},
                       "all_reduce": {"count": 1, "time_ms": reduce, "exposed_ms": reduce, "stream": "compute",
                                      "async": 0, "clock": "device"}}
        peak = rng.randint(30, 33) * 2**30  # GPU-sized figures, a few percent apart: no jumps
        figures = {"collective_ms": scatter + reduce,
                   "memory": {"source": "allocator", "peak_allocated_bytes": peak, "peak_reserved_bytes": peak + 2**31,
                              "phases": {"forward": peak - 2**30, "backward": peak, "step": peak - 2**29}},
                   "live_params_max": rng.randint(10**8, 10**9), "max_live_parameters": 10**9,
                   "trace_cache_invalidations": 0, "prefetch": {"hits": rng.randint(20, 40), "waited": rng.randint(0, 5)}}
        variants.append(f'{json.dumps(figures, separators=(",", ":"))[1:-1]},'
                        f'"collectives":{json.dumps(collectives, separators=(",", ":"))},"comms_logger":false,'
                        f'"events":{json.dumps(events, separators=(",", ":"))}}}\n')
    return variants


def rank_lines(rank: int, world: int, steps: int, variants: List[str]) -> str:
    """One rank's ``steps`` records."""
    return "".join(
        f'{{"schema":3,"engine":"main","rank":{rank},"world_size":{world},"local_rank":{rank % 8},'
        f'"host":"node-{rank // 8}","pid":{4000 + rank % 8},"recording_ranks":null,"dtype":"bfloat16",'
        f'"mode":"train","global_step":{step},"micro_step":{step},"time":1790000000.{step},"clock":"device",'
        f'"step_time_ms":{250 + (step + rank) % 17}.5,"fetch_wait_ms":{(step * 7 + rank) % 11}.25,'
        f'"collective_wait_ms":{(step + rank * 3) % 13}.5,"exposed_wait_ms":0.0,{variants[(step + rank) % 64]}'
        for step in range(steps))


def write_rank(directory: Path, rank: int, world: int, steps: int, variants: List[str]) -> int:
    """One rank's file of ``steps`` records; returns its bytes."""
    lines = rank_lines(rank, world, steps, variants)
    with open(directory / f"zero_fetch_rank_{rank}.jsonl", "w") as out:
        out.write(lines)
    return len(lines)


def generate(directory: Path, ranks: int, steps: int) -> int:
    variants = _variants(random.Random(0))
    return sum(write_rank(directory, rank, ranks, steps, variants) for rank in range(ranks))


# ---------------------------------------------------------------------------------------------------
# a command in a fresh process: its time, peak RSS and that of the processes it forks
# ---------------------------------------------------------------------------------------------------

_CHILD = """
import json, os, resource, sys, time
began = time.perf_counter()
null = os.open(os.devnull, os.O_WRONLY)
saved = os.dup(1)
os.dup2(null, 1)
from ds_profutils.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
seconds = time.perf_counter() - began
os.dup2(saved, 1)
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"code": code, "seconds": seconds, "peak_mb": peak, "workers_peak_mb": workers}))
"""


def run_command(*args: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=ENV,
                          timeout=3600)
    result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"code": None}
    if result["code"] != 0:  # a failed command's time is not a figure
        raise SystemExit(f"ds-profutils {' '.join(args)} failed ({result['code']}):\n{done.stderr[-3000:]}")
    return result


def start_to_finish(*args: str) -> float:
    """Wall time of ``python -m ds_profutils ARGS`` as a user starts it."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ds_profutils", *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=ENV, timeout=600)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"ds-profutils {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def heavy_imports(*args: str) -> List[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ds_profutils", *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, timeout=600)
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
              if line.startswith("import time:")}
    return sorted(loaded & set(HEAVY))


# ---------------------------------------------------------------------------------------------------
# (a) seconds per GB, (b) 1024 ranks x 1000 steps, (c) start time
# ---------------------------------------------------------------------------------------------------


def bench_per_gb(gigabytes: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ranks = 64
        record_bytes = len(rank_lines(0, ranks, 1000, _variants(random.Random(0)))) / 1000
        steps = int(gigabytes * 2**30 / ranks / record_bytes)
        size = generate(Path(tmp), ranks, steps)
        result = run_command("report", tmp)
    per_gb = result["seconds"] / (size / 2**30)
    print(f"(a) report on {size / 2**30:.2f} GB of records ({ranks} ranks x {steps:,} steps): {result['seconds']:.1f} s "
          f"-> {per_gb:.1f} s per GB (target <= {SECONDS_PER_GB_TARGET:.0f} s per GB); peak RSS "
          f"{result['peak_mb']:.0f} MB, readers {result['workers_peak_mb']:.0f} MB")


def bench_big(ranks: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        size = generate(Path(tmp), ranks, steps)
        print(f"(b) {ranks} ranks x {steps} steps: records take {size / 2**30:.2f} GB on disk "
              f"({size / ranks / steps / 1024:.2f} KB per record; generated in {time.perf_counter() - began:.0f} s)")
        # Per rank and step: 10 columns read per rank (global step, step time, two waits, the time inside
        # collectives, iteration, gap, FLOPs, two memory peaks; the disturbed flag's byte rounds in) and the 11
        # of the joined view, 8 bytes each; the rest does not grow with steps.
        arrays_mb = 21 * 8 * ranks * steps / 2**20
        for args in (("report", tmp), ("report", tmp, "--json")):
            result = run_command(*args)
            print(f"    ds-profutils {' '.join(args[:1] + args[2:])}: {result['seconds']:.1f} s "
                  f"({result['seconds'] / (size / 2**30):.1f} s per GB), peak RSS {result['peak_mb']:.0f} MB "
                  f"(readers {result['workers_peak_mb']:.0f} MB); bound: 170 bytes per rank and step "
                  f"({arrays_mb:.0f} MB here) + the interpreter and one record per reader"
                  + (" + the JSON text" if len(args) > 2 else ""))


def bench_start() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        variants = _variants(random.Random(0))
        for rank in range(2):
            write_rank(directory, rank, 2, 10, variants)
        generate_trace(directory / "trace_rank_0.json", 1)
        commands = {"report": ("report", tmp), "report --json": ("report", tmp, "--json"),
                    "timeline": ("timeline", tmp, "-o", str(directory / "timeline.json")),
                    "check-config": ("check-config", str(REPO / "ds_configs" / "zero3_all_profiling.json"))}
        print("(c) start to finish on a small run (2 ranks x 10 steps, a 1 MB trace), median of 7 fresh processes:")
        for name, args in commands.items():
            seconds = statistics.median(start_to_finish(*args) for _ in range(7))
            print(f"    ds-profutils {name:14s} {seconds:5.2f} s (target <= {START_TARGET} s); heavy imports: "
                  f"{', '.join(heavy_imports(*args)) or 'none'}")


# ---------------------------------------------------------------------------------------------------
# (d) the trace summary, against json.load and HolisticTraceAnalysis; (e) the timeline
# ---------------------------------------------------------------------------------------------------


def generate_trace(path: Path, megabytes: int) -> None:
    """A torch-like Chrome trace: steps, nested CPU ops with args, gloo collectives, one event per line."""
    rng = random.Random(0)
    names = [f"aten::op_{i}" for i in range(300)]
    with open(path, "w") as out:
        out.write('{"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 2}, '
                  '"ds_profutils": {"host": "node-0", "rank": 0, "world_size": 2, "step_numbering": "global", '
                  '"profiled_ranks": null}, "baseTimeNanoseconds": 1790000000000000000, "traceEvents": [\n')
        ts, step, first = 0, 0, True
        while out.tell() < megabytes * 2**20:
            events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": ts, "dur": 50_000.0},
                      {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                       "ts": ts + 40_000, "dur": 5_000.0}]
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
# Linux carries it over fork and exec, so each child would start at this process's peak.
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
    ours = run_child(sys.executable, OURS_CHILD, trace, ENV)
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


def bench_traces(megabytes: int, hta_python: Optional[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # The trace alone in its directory, as HTA's TraceAnalysis(trace_dir=...) reads every .json there.
        alone = Path(tmp) / "alone"
        alone.mkdir()
        path = alone / "trace_rank_0.json"
        generate_trace(path, megabytes)
        size = path.stat().st_size / 2**20
        ours = timed_and_peak(lambda: summarize_trace(path))
        whole = timed_and_peak(lambda: json.loads(path.read_text()))
        print(f"(d) trace summary of a {size:.0f} MB trace: {ours['seconds']:.2f} s, peak {ours['peak_mb']:.1f} MB; "
              f"json.load alone: {whole['seconds']:.2f} s, peak {whole['peak_mb']:.0f} MB "
              f"({whole['seconds'] / ours['seconds']:.1f}x our time, "
              f"{whole['peak_mb'] / ours['peak_mb']:.0f}x our memory)")
        if hta_python is None:
            print("    against HolisticTraceAnalysis: not measured; pass --hta-python PATH, an interpreter that can "
                  "import hta (its own venv: pip install torch==2.13.0 HolisticTraceAnalysis)")
        else:
            bench_against_hta(hta_python, path)
        run = Path(tmp) / "run"
        run.mkdir()
        shutil.copy(path, run / "trace_rank_0.json")
        other = path.read_text().replace('"host": "node-0", "rank": 0', '"host": "node-1", "rank": 1', 1)
        (run / "trace_rank_1.json").write_text(other.replace("1790000000000000000", "1790000002000000000", 1))
        result = run_command("timeline", str(run), "-o", str(Path(tmp) / "timeline.json"))
        print(f"(e) timeline of 2 x {size:.0f} MB traces on two hosts: {result['seconds']:.1f} s "
              f"({2 * size / result['seconds']:.0f} MB/s), peak RSS {result['peak_mb']:.0f} MB "
              f"(the traces: {2 * size:.0f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="(a) size of the generated records")
    parser.add_argument("--ranks", type=int, default=1024, help="(b) ranks of the large job")
    parser.add_argument("--steps", type=int, default=1000, help="(b) steps of the large job")
    parser.add_argument("--skip-big", action="store_true", help="skip (b) (it writes ~2.8 GB to the temp dir)")
    parser.add_argument("--trace-mb", type=int, default=56, help="(d, e) size of the generated trace")
    parser.add_argument("--hta-python", metavar="PATH",
                        help="(d) also compare against HolisticTraceAnalysis, run by this interpreter (its own venv)")
    args = parser.parse_args()
    bench_start()
    bench_per_gb(args.gb)
    if not args.skip_big:
        bench_big(args.ranks, args.steps)
    bench_traces(args.trace_mb, args.hta_python)


if __name__ == "__main__":
    main()
