"""@profiler / step_profiler: schedule, step numbering, outputs, settings, the disabled case."""
import functools
import json
import re

import pytest
import torch

import ds_profutils
from ds_profutils import nvtx, profiler, step_profiler
from ds_profutils.config import ConfigError
from ds_profutils.nvtx import instrument_w_nvtx, ranges_active
from ds_profutils.torch_profiler import calls as profiler_calls
from ds_profutils.torch_profiler.run import TAIL_RANGE
from ds_profutils.torch_profiler.decorator import Profiler
from profiler_testing import cycle_steps, profiler_steps, read_trace, train_step

# TensorBoard's profiler plugin: worker name, optional span stamp, fixed suffix.
TENSORBOARD_FILE = re.compile(r"^(?P<worker>.*?)(\.\d+)?\.pt\.trace\.json$")


WORK = "work#"


def _train(steps: int) -> None:
    """``steps`` training steps, each marked ``work#N`` in any trace that records it."""
    for step in range(steps):
        with torch.profiler.record_function(f"{WORK}{step}"):
            train_step()
        step_profiler()


def work_marks(trace):
    """The N of every ``work#N`` range in a trace: which training steps' work it recorded."""
    return sorted(int(e["name"][len(WORK):]) for e in trace["traceEvents"] if e.get("name", "").startswith(WORK))


def test_trace_holds_exactly_the_active_steps_under_their_training_numbers(tmp_path):
    prof = profiler(output_dir=str(tmp_path), skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    prof(_train)(20)

    merged = read_trace(tmp_path / "trace_rank_0.json")
    # cycle 0: skip 0-1, wait 2, warmup 3, active 4-5; cycle 1: wait 6, warmup 7, active 8-9
    assert profiler_steps(merged) == [4, 5, 8, 9]
    assert work_marks(merged) == [4, 5, 8, 9]  # the work of those steps, none of the warmup's or wait's
    for mark in (e for e in merged["traceEvents"] if e.get("name", "").startswith(WORK)):
        step = next(e for e in merged["traceEvents"] if e.get("name") == f"ProfilerStep#{mark['name'][len(WORK):]}")
        assert step["ts"] <= mark["ts"] and mark["ts"] + mark["dur"] <= step["ts"] + step["dur"]
    cycle_files = sorted((tmp_path / "rank_0").iterdir())
    assert [profiler_steps(read_trace(path)) for path in cycle_files] == [[4, 5], [8, 9]]
    assert {TENSORBOARD_FILE.match(path.name)["worker"] for path in cycle_files} == {"rank_0"}
    assert cycle_steps(tmp_path) == [[4, 5], [8, 9]]


def test_torch_profiler_starts_only_at_the_warmup_step(tmp_path, monkeypatch):
    started_at = []

    class SpyProfile(torch.profiler.profile):

        def prepare_trace(self):
            started_at.append(profiler_calls._current.step)
            super().prepare_trace()

    monkeypatch.setattr(torch.profiler, "profile", SpyProfile)
    profiler(output_dir=str(tmp_path), skip_first=3, wait=2, warmup=1, active=1, repeat=3)(_train)(30)
    assert started_at == [5, 9, 13]


def test_warmup_zero_and_endless_repeat(tmp_path):
    profiler(output_dir=str(tmp_path), skip_first=0, wait=1, warmup=0, active=1, repeat=0)(_train)(6)
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 3, 5]


def test_outputs_carry_the_global_rank_and_host(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")  # repeats across nodes: never used for names
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1, summary_ranks=[3])(_train)(3)

    trace = read_trace(tmp_path / "trace_rank_3.json")
    assert trace["distributedInfo"] == {"rank": 3, "world_size": 4}
    assert trace["ds_profutils"]["host"]
    assert (tmp_path / "rank_3").is_dir() and (tmp_path / "summary_rank_3.txt").is_file()
    assert not any(p.name.startswith(".") for p in tmp_path.rglob("*")), "temporary files left behind"


def test_summary_has_flops_column_on_summary_ranks_only(tmp_path, monkeypatch):
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2, with_flops=True)(_train)(4)
    summary = (tmp_path / "summary_rank_0.txt").read_text()
    assert "FLOPs" in summary and "aten::addmm" in summary

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1)(_train)(3)
    assert (tmp_path / "trace_rank_1.json").is_file() and not (tmp_path / "summary_rank_1.txt").exists()


def test_merged_trace_keeps_each_cycles_flow_arrows_apart(tmp_path):
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1, repeat=2)(_train)(5)
    per_cycle = [read_trace(p) for p in sorted((tmp_path / "rank_0").iterdir())]
    merged = read_trace(tmp_path / "trace_rank_0.json")

    def flow_ids(trace):
        return {e["id"] for e in trace["traceEvents"] if e.get("ph") == "s"}

    assert all(flow_ids(trace) for trace in per_cycle)
    assert len(flow_ids(merged)) == sum(len(flow_ids(trace)) for trace in per_cycle)
    assert len(merged["traceEvents"]) < sum(len(t["traceEvents"]) for t in per_cycle)  # names once


def test_instrumented_calls_appear_in_the_trace_only_while_recording(tmp_path):

    @instrument_w_nvtx
    def fetch_batch():
        return torch.ones(2)

    def loop():
        for _ in range(6):
            fetch_batch()
            step_profiler()

    profiler(output_dir=str(tmp_path), skip_first=0, wait=2, warmup=1, active=2)(loop)()
    names = [e["name"] for e in read_trace(tmp_path / "trace_rank_0.json")["traceEvents"]]
    assert names.count(fetch_batch.__qualname__) == 2
    assert not ranges_active()


@pytest.mark.parametrize("steps, recorded", [(5, [1, 2, 3, 4]), (1, [])])
def test_returning_inside_a_window_leaves_no_step_that_never_ran(tmp_path, steps, recorded):
    """Steps 0..steps-1 run; the range opened by the last step_profiler() is the function's tail, not a step."""
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=10)(_train)(steps)
    merged = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(merged) == work_marks(merged) == recorded
    assert [e["name"] for e in merged["traceEvents"] if e.get("name") == TAIL_RANGE] == \
        [TAIL_RANGE]
    assert cycle_steps(tmp_path) == [[1, steps - 1] if recorded else []]
    assert profiler_steps(read_trace(next((tmp_path / "rank_0").iterdir()))) == recorded
    summary = (tmp_path / "summary_rank_0.txt").read_text()
    assert TAIL_RANGE not in summary  # nor counted as a step: FLOP/s are per step that ran
    assert f"; {len(recorded)} recorded steps," in summary if recorded else summary == ""


def test_config_nvtx_section_applies_with_the_profiler_alone(tmp_path, monkeypatch):
    import deepspeed.utils.nvtx

    # the decorator's section stays in force for the process: this test's is forgotten after it, switches and all
    monkeypatch.setattr(nvtx, "_applied", [])
    for module in (nvtx, deepspeed.utils.nvtx):
        for name in ("enable_nvtx", "DEEPSPEED_NVTX_DOMAIN"):
            monkeypatch.setattr(module, name, getattr(module, name))
    profiler(config={"profiler": {"output_dir": str(tmp_path)}, "nvtx": {"enabled": False, "domain": "Job"}})
    assert (nvtx.enable_nvtx, deepspeed.utils.nvtx.enable_nvtx) == (False, False)


def test_context_manager_form(tmp_path):
    with profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=1) as prof:
        assert isinstance(prof, Profiler)
        _train(3)
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1]


class FakeEngine:
    """DeepSpeed's step counting with gradient accumulation over ``accumulation`` micro-steps, from
    ``global_steps`` (a resumed checkpoint restores it).  ``overflows`` lists the optimizer steps fp16 loss
    scaling skips: DeepSpeed still counts them as global steps, but ``was_step_applied()`` is False."""

    def __init__(self, global_steps: int = 0, overflows=(), accumulation: int = 2) -> None:
        self.config = {}  # the ds_config dict, as profiler(config=engine) reads it: no "profiler" section
        self.global_steps = global_steps
        self.micro_steps = 0
        self.overflows = set(overflows)
        self.accumulation = accumulation
        self.applied = False

    def step(self):
        self.micro_steps += 1
        boundary = self.micro_steps % self.accumulation == 0
        self.applied = boundary and self.global_steps not in self.overflows
        if boundary:
            self.global_steps += 1

    def was_step_applied(self):
        return self.applied

    def gradient_accumulation_steps(self):
        return self.accumulation


def _engine_loop(engine, micro_steps):
    for _ in range(micro_steps):
        train_step()
        engine.step()
        step_profiler(engine)


@pytest.mark.parametrize("skip_first, resumed_at, overflows, accumulation, recorded", [
    (1, 0, (), 2, [2, 3]),
    (1, 40, (), 2, [42, 43]),  # numbers continue from a resumed checkpoint; the schedule counts from the call
    (0, 0, (), 2, [0, 1]),  # step 0's range opens before the engine is seen, under the number the engine gives it
    (1, 0, (0, ), 1, [2, 3]),  # fp16's first step overflowed: skipped by the optimizer, still a step
])
def test_follows_engine_optimizer_steps_under_global_numbers(tmp_path, skip_first, resumed_at, overflows,
                                                             accumulation, recorded):
    engine = FakeEngine(resumed_at, overflows, accumulation)
    profiler(output_dir=str(tmp_path), skip_first=skip_first, wait=0, warmup=1 if skip_first else 0,
             active=2)(_engine_loop)(engine, 6 * accumulation)
    _assert_named_by_global_steps(tmp_path, recorded, accumulation)


def _assert_named_by_global_steps(output_dir, recorded, accumulation):
    trace = read_trace(output_dir / "trace_rank_0.json")
    assert profiler_steps(trace) == recorded
    assert trace["ds_profutils"]["step_numbering"] == "global"
    assert cycle_steps(output_dir) == [[recorded[0], recorded[-1]]]
    first = next(e for e in trace["traceEvents"] if e["name"] == f"ProfilerStep#{recorded[0]}")
    backwards = [e for e in trace["traceEvents"] if e["name"] == "autograd::engine::evaluate_function: AddmmBackward0"
                 and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
    assert len(backwards) == accumulation  # every micro-step of an optimizer step inside one profiler step


def test_a_window_from_the_first_step_is_named_as_recorded(tmp_path, ds_caplog):
    """A range is named when it opens: the call's first step is named before step_profiler(engine) shows the
    engine.  Given the engine beforehand, global numbers from the start; otherwise, where they would differ
    (a resumed engine), the call's count for the whole run, and one line says why.  Never renamed afterwards."""
    schedule = dict(skip_first=0, wait=0, warmup=0, active=2)
    engine = FakeEngine(global_steps=40)
    profiler(config=engine, enabled=True, output_dir=str(tmp_path / "known"), **schedule)(_engine_loop)(engine, 12)
    _assert_named_by_global_steps(tmp_path / "known", [40, 41], accumulation=2)
    assert "counts this call's steps" not in ds_caplog.text

    engine = FakeEngine(global_steps=40)
    profiler(output_dir=str(tmp_path / "seen_later"), **schedule)(_engine_loop)(engine, 12)
    trace = read_trace(tmp_path / "seen_later" / "trace_rank_0.json")
    assert profiler_steps(trace) == [0, 1] and trace["ds_profutils"]["step_numbering"] == "call"
    assert ds_caplog.text.count("counts this call's steps, not the engine's global steps") == 1
    assert "(it is global step 40)" in ds_caplog.text


def test_numbers_continue_across_calls_and_metadata_says_which(tmp_path):
    engine = FakeEngine()
    for call in ("first", "second"):
        profiler(output_dir=str(tmp_path / call), skip_first=1, wait=0, warmup=0, active=1)(_engine_loop)(engine, 6)
    assert profiler_steps(read_trace(tmp_path / "second" / "trace_rank_0.json")) == [4]
    profiler(output_dir=str(tmp_path / "call"), ranks=[0], skip_first=1, wait=0, warmup=0, active=1)(_train)(3)
    metadata = read_trace(tmp_path / "call" / "trace_rank_0.json")["ds_profutils"]
    assert (metadata["step_numbering"], metadata["profiled_ranks"], metadata["rank"]) == ("call", [0], 0)
    assert read_trace(tmp_path / "first" / "trace_rank_0.json")["ds_profutils"]["profiled_ranks"] is None


def test_settings_come_from_config_then_keywords(tmp_path):
    config = {"train_batch_size": 1, "profiler": {"output_dir": str(tmp_path), "active": 2, "skip_first": 0,
                                                   "wait": 0, "warmup": 0}}
    assert profiler(config=config).settings.active == 2
    assert profiler(config=config, active=5).settings.active == 5
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    profiler(config=str(path), active=1)(_train)(3)
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [0]
    with pytest.raises(ConfigError, match=r"profiler\.active"):
        profiler(active=0)


def _plain(x):
    """Docs kept."""
    return x + 1


@pytest.mark.parametrize("make", [
    pytest.param(lambda: profiler(enabled=False), id="enabled=False"),
    pytest.param(lambda: profiler(config={"train_batch_size": 1}), id="config-without-section"),
])
def test_disabled_profiler_returns_the_function_itself(make):
    assert make()(_plain) is _plain


def test_keywords_over_a_config_without_the_section_say_why_it_is_off(tmp_path, ds_caplog):
    """The config is the switch; keyword settings given with one that has no "profiler" section are not
    dropped silently: one line says so, and enabled=True profiles."""
    config = {"train_batch_size": 1}
    assert profiler(config=config)(_plain) is _plain
    assert "profiler: off" not in ds_caplog.text  # nothing was asked of it
    assert profiler(config=config, active=2, with_stack=True)(_plain) is _plain
    line, = [r.getMessage() for r in ds_caplog.records if r.getMessage().startswith("profiler: off")]
    assert 'no "profiler" section' in line and "(active=2, with_stack=True)" in line and "enabled=True" in line
    profiler(config=config, enabled=True, output_dir=str(tmp_path), skip_first=0, wait=0, warmup=0, active=1)(_train)(2)
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [0]


def test_environment_switches_it_off_over_keywords(monkeypatch):
    monkeypatch.setenv("DS_PROFUTILS_PROFILER_ENABLED", "0")
    assert profiler(enabled=True)(_plain) is _plain


def test_which_rank_profiles_is_decided_at_the_first_call(tmp_path, monkeypatch):
    """Under mpirun or SLURM the rank may only be known once the job runs: decorating reads nothing."""
    kept = profiler(output_dir=str(tmp_path / "kept"), ranks=[1], skip_first=0, wait=0, warmup=0, active=1)(_train)
    left_out = profiler(output_dir=str(tmp_path / "left_out"), ranks=[0], skip_first=0, wait=0, warmup=0,
                        active=1)(_train)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    kept(2)
    left_out(2)
    assert profiler_steps(read_trace(tmp_path / "kept" / "trace_rank_1.json")) == [0]
    assert not (tmp_path / "left_out").exists()


def test_rank_outside_world_size_is_refused_at_the_first_call(monkeypatch):
    ran = []
    decorated = profiler(ranks=[0, 2])(lambda: ran.append(1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"profiler\.ranks: ranks \[2\] are outside the world size 2"):
        decorated()
    assert ran == []


def test_decorator_keeps_name_doc_and_wrapped(tmp_path):
    decorated = profiler(output_dir=str(tmp_path))(_plain)
    assert decorated is not _plain and decorated.__wrapped__ is _plain
    assert (decorated.__name__, decorated.__doc__) == ("_plain", "Docs kept.")
    assert decorated(1) == 2
    stacked = functools.lru_cache(None)(decorated)
    assert stacked(2) == 3


def test_step_profiler_is_idle_again_after_a_run(tmp_path):
    profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=0, active=1)(_train)(2)
    assert profiler_calls._current is None
    assert ds_profutils.step_profiler is step_profiler
    step_profiler()  # no run: nothing happens


def test_a_checkpoint_loaded_inside_the_decorated_call_continues_the_earlier_processs_files(tmp_path):
    """A new process whose decorated train() loads the checkpoint of global step 4 (``engine.load_checkpoint()``)
    before its first step: the run began at step 4, so it takes up the earlier process's cycle of steps 2-3."""
    from ds_profutils.torch_profiler import writer as writer_module

    schedule = dict(enabled=True, output_dir=str(tmp_path), skip_first=1, wait=0, warmup=1, active=2)
    engine = FakeEngine()
    profiler(config=engine, **schedule)(_engine_loop)(engine, 8)  # global steps 0-3: cycle 2-3
    writer_module._writers.clear()  # a new process

    def resumed_loop(engine, micro_steps):
        engine.global_steps = 4  # the checkpoint, loaded inside the call
        _engine_loop(engine, micro_steps)

    resumed = FakeEngine()
    profiler(config=resumed, **schedule)(resumed_loop)(resumed, 8)  # the load's jump ends the call's first step
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3, 5, 6]
