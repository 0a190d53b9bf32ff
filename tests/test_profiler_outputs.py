"""What a profiled run leaves and says: files on disk at each cycle end, the run trace spliced cycle by cycle
against a json-level merge (and what a kill in the middle leaves), streaming renames, and the end-of-run
printout with the comms logger's summary."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ds_profutils import profiler, step_profiler
from ds_profutils.comms_logging import CommsLogger
from ds_profutils.outputs import process_identity
from ds_profutils.torch_profiler import export
from ds_profutils.report import build_report
from ds_profutils.timeline.merge import scan_trace
from ds_profutils.torch_profiler.export import RunTrace, read_layout, rename_trace_events
from profiler_testing import profiler_steps, read_trace, train_step

LINK_FIELDS, LINK_ARGS = ("id", "bind_id"), ("External id", "correlation")


def _train(steps, seen=None, output_dir=None):
    for step in range(steps):
        train_step()
        if seen is not None:  # what a job killed now would leave
            seen.append(profiler_steps(read_trace(output_dir / "trace_rank_0.json"))
                        if (output_dir / "trace_rank_0.json").exists() else [])
        step_profiler()


def test_finished_cycles_are_on_disk_when_each_cycle_ends(tmp_path):
    seen = []
    profiler(output_dir=str(tmp_path), skip_first=0, wait=1, warmup=0, active=2, repeat=3)(_train)(9, seen, tmp_path)
    # cycle c records steps 3c+1, 3c+2; the run trace holds them from the step after
    assert seen == [[], [], [], [1, 2], [1, 2], [1, 2], [1, 2, 4, 5], [1, 2, 4, 5], [1, 2, 4, 5]]
    assert len(list((tmp_path / "rank_0").iterdir())) == 3


def _json_merge(cycle_files):
    """The run trace's events as a json-level merge defines them: link ids shifted past the previous
    cycles' largest, each process/thread name record once."""
    events, offset, seen = [], 0, set()
    for path in cycle_files:
        largest = offset - 1
        for event in read_trace(path)["traceEvents"]:
            if event.get("ph") == "M":
                key = (event["name"], event["pid"], event["tid"])
                if key in seen:
                    continue
                seen.add(key)
            for holder, keys in ((event, LINK_FIELDS), (event.get("args", {}), LINK_ARGS)):
                for key in keys:
                    if isinstance(holder.get(key), int):
                        holder[key] += offset
                        largest = max(largest, holder[key])
            events.append(event)
        offset = largest + 1
    return events


@pytest.fixture(scope="module")
def cycle_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("cycles")
    profiler(output_dir=str(out), skip_first=0, wait=0, warmup=1, active=2, repeat=3, record_shapes=True)(_train)(9)
    return sorted((out / "rank_0").iterdir())


def test_spliced_run_trace_equals_a_json_merge_whatever_the_chunk_size(tmp_path, cycle_files, monkeypatch):
    merged = {}
    for chunk in (export._CHUNK, 4096):
        monkeypatch.setattr(export, "_CHUNK", chunk)
        trace = RunTrace(tmp_path / f"trace_{chunk}.json", process_identity())
        trace.add(cycle_files[:1], {"rank": 0})  # written whole
        trace.add(cycle_files[1:2], {"rank": 0})  # spliced in
        trace.add(cycle_files[2:], {"rank": 0})
        merged[chunk] = (tmp_path / f"trace_{chunk}.json").read_bytes()
    assert merged[4096] == merged[export._CHUNK]
    result = json.loads(merged[4096])
    assert result["traceEvents"] == _json_merge(cycle_files)
    assert result["ds_profutils"] == {"rank": 0}
    assert result["distributedInfo"] == read_trace(cycle_files[0])["distributedInfo"]
    flows = [e for e in result["traceEvents"] if e.get("ph") in ("s", "f")]
    assert flows and len({e["id"] for e in flows if e["ph"] == "s"}) == len([e for e in flows if e["ph"] == "s"])


def test_a_cycle_writes_only_its_own_bytes(tmp_path, cycle_files):
    """Flat cost per cycle: each splice leaves the bytes already there as they were, in the same file."""
    path = tmp_path / "trace.json"
    trace = RunTrace(path, process_identity())
    trace.add(cycle_files[:1], {})
    before, inode = path.read_bytes(), path.stat().st_ino
    for cycle_file in cycle_files[1:]:
        trace.add([cycle_file], {})
        after = path.read_bytes()
        closing = len(before) - len(b"\n]}\n")
        assert after[:closing + 1] == before[:closing + 1] and after[closing + 1:closing + 3] == b"  "
        assert len(after) - len(before) < cycle_file.stat().st_size  # the cycle's events, not the run's
        assert path.stat().st_ino == inode
        before = after


def test_a_failed_splice_is_undone_and_the_next_cycle_still_goes_in(tmp_path, cycle_files, monkeypatch):
    path = tmp_path / "trace.json"
    trace = RunTrace(path, process_identity())
    trace.add(cycle_files[:1], {})

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", disk_full)
        with pytest.raises(OSError):
            trace.add(cycle_files[1:2], {})
    assert profiler_steps(read_trace(path)) == profiler_steps(read_trace(cycle_files[0]))
    trace.add(cycle_files[1:], {})  # the failed cycle again, with the next
    assert profiler_steps(read_trace(path)) == sorted(s for f in cycle_files for s in profiler_steps(read_trace(f)))


_KILLED_MID_SPLICE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import export

    copy = export._EventCopier.copy
    def copy_then_die(self, source, layout, out, separator):
        if self.offset:  # a spliced cycle: half its events, then SIGKILL
            out.write(separator + source.read()[layout.events_start:(layout.events_start + layout.events_end) // 2])
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return copy(self, source, layout, out, separator)
    export._EventCopier.copy = copy_then_die

    model = torch.nn.Linear(16, 16)
    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=1, active=2, repeat=0)
    def train():
        for _ in range(9):
            model(torch.randn(4, 16)).sum().backward()
            step_profiler()
    train()
""")


def test_a_kill_in_the_middle_of_a_splice_leaves_every_earlier_cycle_to_the_report(tmp_path):
    job = subprocess.run([sys.executable, "-c", _KILLED_MID_SPLICE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == -signal.SIGKILL, job.stderr
    cycle_files = sorted((tmp_path / "rank_0").glob("*.pt.trace.json"))
    assert [profiler_steps(read_trace(p)) for p in cycle_files] == [[1, 2], [4, 5]]  # each cycle's file is whole
    with pytest.raises(json.JSONDecodeError, match="Extra data"):  # the cut copy follows the whole trace
        read_trace(tmp_path / "trace_rank_0.json")
    report = build_report(tmp_path)
    assert [step["step"] for step in report["traces"][0]["steps"]] == [1, 2] and report["incomplete"] == []
    assert scan_trace(tmp_path / "trace_rank_0.json", 0).error is None


def test_streaming_rename_equals_a_json_rename(tmp_path, cycle_files, monkeypatch):
    monkeypatch.setattr(export, "_CHUNK", 4096)
    path = tmp_path / "renamed.json"
    path.write_bytes(cycle_files[0].read_bytes())
    old = f"ProfilerStep#{profiler_steps(read_trace(path))[-1]}"
    rename_trace_events(path, {old: "tail \"quoted\"", "aten::addmm": "mm"})
    expected = read_trace(cycle_files[0])
    for event in expected["traceEvents"]:
        event["name"] = {old: "tail \"quoted\"", "aten::addmm": "mm"}.get(event.get("name"), event.get("name"))
    assert read_trace(path) == expected
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_layout_is_found_from_the_ends_of_the_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"a": [1], "traceEvents": [{"name": "x]"}],\n"traceName": "runs[1].json"}')
    layout = read_layout(path)
    assert layout.header == {"a": [1]}
    assert path.read_bytes()[layout.events_start:layout.events_end] == b'{"name": "x]"}'
    path.write_text('{"traceEvents": "none"}')
    with pytest.raises(ValueError, match="no traceEvents array"):
        read_layout(path)


def test_rank_0_prints_where_the_files_went_and_the_labelled_flops(tmp_path, capsys, monkeypatch):
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2, with_flops=True,
             peak_tflops=0.5)(_train)(4)
    out = capsys.readouterr().out
    assert "ds_profutils profiler: rank 0 recorded steps 1-2 (1 cycle(s))" in out
    for path in (tmp_path / "trace_rank_0.json", tmp_path / "rank_0", tmp_path / "summary_rank_0.txt"):
        assert str(path) in out
    assert "aten::addmm" in out and "% of peak_tflops 0.5" in out
    assert "counted-operator FLOP/s" in out and "not model FLOPs utilisation (MFU)" in out
    assert "counted-operator FLOP/s" in (tmp_path / "summary_rank_0.txt").read_text()

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1)(_train)(3)
    assert capsys.readouterr().out == ""  # rank 1 logs, rank 0 prints


@pytest.fixture
def comms_logger():
    """DeepSpeed's comms logger switched on (as ``"comms_logger": {"enabled": true}`` does), then put back."""
    from deepspeed.comm import comm as ds_comm

    saved = ds_comm.comms_logger
    ds_comm.comms_logger = CommsLogger()
    ds_comm.comms_logger.enabled = True
    yield ds_comm.comms_logger
    ds_comm.comms_logger = saved


def test_comms_logger_summary_at_a_normal_end_only_and_only_when_every_rank_profiles(tmp_path, capsys, comms_logger,
                                                                                      monkeypatch, ds_caplog):
    schedule = dict(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1)
    profiler(**schedule)(_train)(3)
    assert "Comm. Op" in capsys.readouterr().out

    def fails():
        _train(2)
        raise ValueError("boom")

    with pytest.raises(ValueError):
        profiler(**schedule)(fails)()
    assert "Comm. Op" not in capsys.readouterr().out

    monkeypatch.setenv("WORLD_SIZE", "2")
    profiler(**schedule, ranks=[0])(_train)(3)
    assert "Comm. Op" not in capsys.readouterr().out
    assert "comms_logger summary not shown" in ds_caplog.text
