"""The hang watchdog in one process, on the stand-in engine: its file when no optimizer step ends for the
timeout (engine, step, phase, the collective inside now, every thread's stack, memory), again each timeout, the
file saying ``resolved`` when the step ends after all, and the thread's end at close and when the engine goes.
The launcher job that hangs for real is in test_hangs_launcher.py."""
import gc
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ds_profutils.engine import Attachment
from ds_profutils.engine.hangs import sequence, watch_engine
from ds_profutils.engine.hangs.watchdog import POLL_SECONDS

from test_zero_attach import Engine

TIMEOUT_S = 1
REPO = Path(__file__).resolve().parent.parent


def watched(engine, tmp_path, name="main"):
    attachment = Attachment(engine, name, None)
    watch = watch_engine(attachment.hooks, name, str(tmp_path), TIMEOUT_S)
    attachment.add(watch, watch.close)
    return attachment


def watchdog_threads():
    return [thread for thread in threading.enumerate() if thread.name == "ds_profutils-hang-watchdog"]


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def stuck_inside_an_all_reduce(seconds):
    """The training thread inside a collective of group (0, 1) (what a wrapper marks) for ``seconds``."""
    collective = sequence.collective_started("all_reduce", (0, 1), 4096)
    try:
        time.sleep(seconds)
    finally:
        sequence.collective_ended(collective)
    return collective.seq


def test_a_rank_stuck_past_the_timeout_writes_where_it_is_and_resolved_when_the_step_ends(tmp_path):
    engine = Engine()
    path = tmp_path / "hang_rank_0.json"
    with watched(engine, tmp_path):
        for _ in range(3):
            engine.train_step()
        engine.module.train()
        engine.forward()  # then stuck in the backward, inside a collective, for three timeouts
        seq = stuck_inside_an_all_reduce(3 * TIMEOUT_S + 2 * POLL_SECONDS)
        hang = json.loads(path.read_text())
        engine.backward()
        engine.step()
        assert wait_for(lambda: json.loads(path.read_text())["resolved"], 4 * POLL_SECONDS)
        resolved = json.loads(path.read_text())
    assert not hang["resolved"] and hang["writes"] >= 2 and hang["stuck_s"] >= 2 * TIMEOUT_S
    assert hang["engines"] == [{"name": "main", "global_step": 3, "phase": "backward"}]
    inside = hang["collective"]
    assert (inside["name"], inside["group"], inside["seq"], inside["bytes"]) == ("all_reduce", [0, 1], seq, 4096)
    assert inside["waiting_s"] >= TIMEOUT_S and inside["ended"] is None
    assert {"group": [0, 1], "seq": seq, "ended_seq": seq - 1} in hang["groups"]
    training = [thread for thread in hang["threads"] if thread["training"]]
    assert len(training) == 1
    functions = [frame["function"] for frame in training[0]["stack"]]
    assert functions.index("stuck_inside_an_all_reduce") < functions.index(
        "test_a_rank_stuck_past_the_timeout_writes_where_it_is_and_resolved_when_the_step_ends")  # innermost first
    assert training[0]["stack"][0]["file"].endswith("test_hangs.py")
    assert hang["memory"]["rss_bytes"] > 0 and hang["pid"] > 0 and hang["host"]
    assert resolved["resolved"] and resolved["resolved_after_s"] >= 3 * TIMEOUT_S
    assert resolved["collective"] is None and resolved["last_collective"]["seq"] == seq
    assert not list(tmp_path.glob(".hang_rank_0.json.*"))  # the temporary files were renamed


def test_steps_that_end_in_time_write_nothing_and_close_ends_the_thread(tmp_path):
    engine = Engine()
    attachment = watched(engine, tmp_path)
    assert len(watchdog_threads()) == 1
    for _ in range(int(3 * TIMEOUT_S / 0.2)):
        engine.train_step()
        time.sleep(0.2)
    attachment.close()
    assert not list(tmp_path.iterdir())
    assert wait_for(lambda: not watchdog_threads(), 3 * POLL_SECONDS)


def test_the_thread_ends_when_the_engine_is_collected_and_one_thread_watches_several(tmp_path):
    first, second = Engine(), Engine()
    watched(first, tmp_path)
    watched(second, tmp_path, name="critic")
    assert len(watchdog_threads()) == 1
    del first, second
    gc.collect()
    assert wait_for(lambda: not watchdog_threads(), 3 * POLL_SECONDS)


def test_a_hang_before_the_first_step_is_found(tmp_path):
    engine = Engine()
    with watched(engine, tmp_path):
        time.sleep(TIMEOUT_S + 2 * POLL_SECONDS)
    hang = json.loads((tmp_path / "hang_rank_0.json").read_text())
    assert hang["engines"] == [{"name": "main", "global_step": 0, "phase": "between steps"}]


def test_waiting_on_an_async_collectives_handle_is_being_inside_it_again():
    collective = sequence.collective_started("all_gather_into_tensor", (0, 1, 2), 512)
    sequence.collective_ended(collective)  # launched: the call returned
    group = next(group for group in sequence.progress() if group.ranks == (0, 1, 2))
    assert group.current is None and group.last is collective
    sequence.collective_resumed(collective)  # the program waits on its handle
    assert group.current is collective and collective.ended_ns is None
    assert group.seq == collective.seq  # no new sequence number
    sequence.collective_ended(collective)
    assert group.current is None and collective.ended_ns is not None


@pytest.mark.parametrize("where", ["as the end's clock read returns", "as collective_ended starts"])
@pytest.mark.parametrize("wrapper", ["torch.distributed", "deepspeed.comm"])
def test_an_interruption_as_a_collective_ends_leaves_the_rank_outside_it(monkeypatch, wrapper, where):
    """A signal handler's exception (a KeyboardInterrupt the program catches to train on) raised where CPython runs
    handlers -- as a call returns, as a function starts -- through each of our wrappers: the thread is inside none
    of our wrappers' calls afterwards (the program's next collective is counted and timed, not passed through as
    one of ours), and a collective is never ended twice (deepspeed.comm's ``finally`` ends one its timed call did
    not).  Raised as the clock read returns, the group's last is it; raised as the end starts, deepspeed.comm's
    wrapper ends it in its ``finally``, torch.distributed's leaves it the group's current until the next."""
    from deepspeed.comm import comm as deepspeed_comm

    from ds_profutils.engine import collectives, torch_collectives
    from ds_profutils.engine.step import EngineCollectives, StepRecord

    class Backend:  # deepspeed.comm's backend object
        @staticmethod
        def all_reduce(*args, **kwargs):
            pass

    calls = []

    def interrupted(real, at_call):
        """``real``, but its ``at_call``-th call raises KeyboardInterrupt instead."""
        def call(*args):
            calls.append(None)
            if len(calls) == at_call:
                raise KeyboardInterrupt
            return real(*args)
        return call

    monkeypatch.setattr(torch.distributed, "all_reduce", Backend.all_reduce)
    monkeypatch.setattr(deepspeed_comm, "cdb", Backend())
    recorded = EngineCollectives(Engine())
    recorded.step = StepRecord({"mode": "train"}, None, None)  # deepspeed.comm's call is timed for a recorded step
    detach = collectives.attach_engine(recorded, None)  # deepspeed.comm's backend and torch.distributed wrapped
    try:
        with monkeypatch.context() as interrupting:
            if where == "as collective_ended starts":
                for module in (collectives, torch_collectives):
                    interrupting.setattr(module, "collective_ended", interrupted(sequence.collective_ended, 1))
            else:  # the start's clock read, then the end's
                interrupting.setattr(sequence, "perf_counter_ns", interrupted(time.perf_counter_ns, 2))
            with pytest.raises(KeyboardInterrupt):
                if wrapper == "torch.distributed":
                    torch.distributed.all_reduce(torch.ones(1), group=(0, 1, 5))
                else:
                    deepspeed_comm.cdb.all_reduce(torch.ones(1), None, (0, 1, 5))
        group = next(group for group in sequence.progress() if group.ranks == (0, 1, 5))
        cut = group.current or group.last
        assert cut.name == "all_reduce" and cut.seq == group.seq
        if where == "as collective_ended starts" and wrapper == "torch.distributed":
            assert group.current is cut and cut.ended_ns is None  # until the group's next
        else:
            assert group.current is None and group.last is cut and cut.ended_ns is not None
        if where == "as the end's clock read returns":  # ended once, provisionally at its start: never again
            assert cut.ended_ns == cut.started_ns
        recorded.step = None  # between steps: the program's own collective is a wait of the gap
        recorded.take_gap_collective_ms()
        torch.distributed.all_reduce(torch.ones(1), group=(0, 1, 5))  # the program goes on
        assert group.seq == cut.seq + 1 and group.current is None and group.last.seq == group.seq
        assert recorded.take_gap_collective_ms() > 0  # timed as the program's: not passed through as one of ours
    finally:
        detach()


def test_the_watch_holds_its_engine_weakly(tmp_path):
    """The hooks hold the engine through a weakref (DESIGN, "Isolation"); a listener holding it strongly would keep
    a dropped engine alive until a cycle collection, or for good where a cycle is not collected."""
    import weakref

    from ds_profutils.engine.hooks import EngineHooks

    engine = Engine()
    hooks = EngineHooks(engine)
    watch = watch_engine(hooks, "main", str(tmp_path), 300)
    hooks.add(watch)
    ref = weakref.ref(engine)
    hooks.remove()  # the hooks' wrappers on the engine hold it (a cycle while attached); the watch must not
    del engine
    assert ref() is None and watch.where() == {"name": "main", "global_step": None, "phase": "between steps"}
    watch.close()


def test_a_pipeline_send_is_on_its_pairs_sequence_while_it_blocks(monkeypatch):
    """A pipeline rank stuck in a send to its neighbour stage is inside a collective of the pair (both ends count
    on one key, so a hang lines the two ranks up), not "outside collectives"."""
    import torch
    import torch.distributed as dist

    from ds_profutils.engine.collectives import _p2p_counted
    from ds_profutils.engine.torch_collectives import handing_on

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    seen = []

    def send(tensor, dst, group=None, tag=0):  # a torch.distributed collective called here would be the send's own
        group_of_pair = next(group for group in sequence.progress() if group.ranks == (2, 3))
        seen.append((group_of_pair.current.name, group_of_pair.current.seq, handing_on.depth > 0))

    counted = _p2p_counted("send", send)
    counted(torch.zeros(4), 2)
    counted(torch.zeros(4), dst=2)
    _p2p_counted("recv", lambda tensor, src=None: seen.append("from anyone"))(torch.zeros(4))
    first = seen[0][1]
    assert seen == [("send", first, True), ("send", first + 1, True), "from anyone"]
    group = next(group for group in sequence.progress() if group.ranks == (2, 3))
    assert group.current is None and group.last.name == "send" and group.last.nbytes == 16


def test_the_phase_the_hooks_keep_follows_forward_backward_and_step():
    """What a hang file says of where the engine was: written by the hooks at each phase change, read by the
    watchdog's thread; a torch-style ``loss.backward()`` ends its backward too, an eval forward leaves none to come."""
    from ds_profutils.engine.hooks import EngineHooks

    engine = Engine()
    seen = []
    engine.module.register_forward_pre_hook(lambda module, args: seen.append(hooks.phase))  # after ours
    step = engine.step
    engine.step = lambda: (seen.append(hooks.phase), step())
    hooks = EngineHooks(engine)
    engine.module.train()
    engine.forward()
    after_forward = hooks.phase
    engine.backward()
    after_backward = hooks.phase
    engine.step()
    assert seen == ["forward", "step"] and (after_forward, after_backward, hooks.phase) == (
        "backward", "between steps", "between steps")
    engine.eval_forward()
    assert hooks.phase == "between steps"
    out = engine.forward(torch.ones(1, requires_grad=True))
    assert out.requires_grad and hooks.phase == "backward"
    out.sum().backward()  # torch-style
    assert hooks.phase == "between steps"
    hooks.remove()


def test_a_step_that_ends_just_before_the_job_closes_is_written_resolved(tmp_path):
    """A Trainer job whose last step was slow: the step ends, the job closes at once (before the thread's next look),
    and the process may end; the file must not stay a HANG of a job that finished."""
    engine = Engine()
    path = tmp_path / "hang_rank_0.json"
    attachment = watched(engine, tmp_path)
    assert wait_for(path.exists, TIMEOUT_S + 3 * POLL_SECONDS)  # stuck before its first step
    engine.train_step()
    attachment.close()  # at once: no look of the thread's own comes between
    hang = json.loads(path.read_text())
    assert hang["resolved"] and hang["resolved_after_s"] >= TIMEOUT_S and not watchdog_threads()


@pytest.mark.parametrize("ending", ["closed by the program", "an error in flight", "a watch's own error",
                                    "an uncaught exception", "a SIGTERM"])
def test_a_wait_the_program_ends_by_closing_says_so_but_one_ended_by_an_error_or_a_signal_stays_a_hang(
        tmp_path, monkeypatch, ending):
    """A long evaluation or save after the last step, then the program's own close(): the file says the program closed
    the engine (the report does not call that a HANG: a too low timeout costs a file, not a false alarm), keeping
    where the rank was.  Where an error or a SIGTERM ends the job, the wait was not over: a hung job is ended so, and
    its files must go on saying HANG."""
    from ds_profutils import _signal_exit

    engine = Engine()
    path = tmp_path / "hang_rank_0.json"
    attachment = watched(engine, tmp_path)
    engine.train_step()
    assert wait_for(path.exists, TIMEOUT_S + 3 * POLL_SECONDS)  # the evaluation after the last step
    if ending == "closed by the program":
        attachment.close()
    elif ending == "an error in flight":
        with pytest.raises(RuntimeError, match="gloo timeout"), attachment:
            raise RuntimeError("gloo timeout")
    elif ending == "a watch's own error":
        attachment._closers[0].__self__.stop_after_error(ValueError("ours"))
    else:
        if ending == "an uncaught exception":  # printed by the interpreter before its exit handlers run
            monkeypatch.setattr("sys.last_value", RuntimeError("gloo timeout"), raising=False)
        else:
            monkeypatch.setattr(_signal_exit, "_ending_on_signal", True)
        attachment.close()
    assert not watchdog_threads()
    hang = json.loads(path.read_text())
    assert not hang["resolved"]
    if ending == "closed by the program":
        assert hang["closed_after_s"] >= TIMEOUT_S
        training = next(thread for thread in hang["threads"] if thread["training"])
        assert "wait_for" in [frame["function"] for frame in training["stack"]]  # where it was, not the close
    else:
        assert hang["closed_after_s"] is None
    attachment.close()


def test_every_directory_a_run_watches_loses_an_earlier_runs_hang_file_and_none_this_run_wrote(tmp_path):
    """A second engine writing to its own output_dir joins the running watchdog: an earlier run's unresolved file
    there would read as this run's hang.  A directory the watchdog already writes into keeps its file."""
    first_dir, second_dir = tmp_path / "actor", tmp_path / "critic"
    for directory in (first_dir, second_dir):
        directory.mkdir()
        (directory / "hang_rank_0.json").write_text(json.dumps({"resolved": False, "pid": 1}))
    first = watched(Engine(), first_dir)
    assert not (first_dir / "hang_rank_0.json").exists()
    second = watched(Engine(), second_dir, name="critic")
    assert not (second_dir / "hang_rank_0.json").exists()
    assert wait_for((first_dir / "hang_rank_0.json").exists, TIMEOUT_S + 3 * POLL_SECONDS)  # no step: this run's
    third = watched(Engine(), first_dir, name="reward")
    assert json.loads((first_dir / "hang_rank_0.json").read_text())["pid"] != 1
    for attachment in (third, second, first):
        attachment.close()


def test_a_collective_given_its_tensors_by_keyword_has_its_bytes():
    """deepspeed.comm calls its backend's all_gather_into_tensor and reduce_scatter_tensor with the tensors by keyword
    (ZeRO's commonest collectives): a hang file names their size as it does for positional ones."""
    output, shard = torch.zeros(64), torch.zeros(32)
    by_keyword = sequence.call_started("all_gather_into_tensor", (), {
        "output_tensor": output, "input_tensor": shard, "group": (0, 1), "async_op": False}, 2)
    sequence.collective_ended(by_keyword)
    by_position = sequence.call_started("all_gather_into_tensor", (output, shard, (0, 1)), {}, 2)
    sequence.collective_ended(by_position)
    assert by_keyword.as_dict()["bytes"] == by_position.as_dict()["bytes"] == output.nbytes
    scalar_first = sequence.call_started("all_reduce", (), {"tensor": shard, "op": None, "group": (0, 1)}, 2)
    sequence.collective_ended(scalar_first)
    assert scalar_first.as_dict()["bytes"] == shard.nbytes


def test_a_pipeline_send_given_its_tensor_by_keyword_has_its_bytes(monkeypatch):
    """deepspeed.comm's send and recv call the backend with keywords (``tensor=``, ``dst=``/``src=``)."""
    import torch.distributed as dist
    from ds_profutils.engine import collectives

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    seen = []
    send = collectives._p2p_counted("send", lambda *args, **kwargs: seen.append(sequence.progress()))
    tensor = torch.zeros(16)
    send(tensor, 1)
    send(tensor=tensor, dst=1)  # the last on the pair's sequence
    pair = next(group for group in sequence.progress() if group.ranks == (0, 1))
    assert pair.last.as_dict()["bytes"] == tensor.nbytes and len(seen) == 2


def test_an_engine_collected_after_the_thread_looked_at_it_ends_the_thread_and_writes_no_hang(tmp_path):
    """An engine dropped without close() (an RLHF reload, a sweep) after the watchdog has looked at it: the thread
    holds it weakly between looks, so it ends, and writes no hang of an engine that is gone."""
    engine = Engine()
    watched(engine, tmp_path)
    for _ in range(int(2.5 * POLL_SECONDS / 0.1)):  # the thread looks at it twice or more
        engine.train_step()
        time.sleep(0.1)
    del engine
    gc.collect()
    assert wait_for(lambda: not watchdog_threads(), 3 * POLL_SECONDS)
    time.sleep(TIMEOUT_S)
    assert not list(tmp_path.glob("hang_rank_*.json"))


@pytest.mark.parametrize("ending", ["a step", "the program's close"])
def test_a_wait_that_ends_says_so_in_every_directory_its_hang_file_went_to(tmp_path, ending):
    """An actor writing to one directory and a critic to another, both stuck; the actor closed first, then the wait
    ends (the critic steps, or the program closes it): the actor's directory must not go on saying HANG."""
    actor, critic = Engine(), Engine()
    first = watched(actor, tmp_path / "actor")
    second = watched(critic, tmp_path / "critic", name="critic")
    actor_file, critic_file = tmp_path / "actor" / "hang_rank_0.json", tmp_path / "critic" / "hang_rank_0.json"
    assert wait_for(lambda: actor_file.exists() and critic_file.exists(), TIMEOUT_S + 3 * POLL_SECONDS)
    first.close()
    time.sleep(1.5 * POLL_SECONDS)  # a look of the thread's with the critic alone
    if ending == "a step":
        critic.train_step()
        assert wait_for(lambda: json.loads(actor_file.read_text())["resolved"], 3 * POLL_SECONDS)
        second.close()
    else:
        second.close()
        closed = json.loads(actor_file.read_text())
        assert closed["closed_after_s"] is not None
        assert {engine["name"] for engine in closed["engines"]} == {"main", "critic"}  # its own last file, where it was
    for path in (actor_file, critic_file):
        content = json.loads(path.read_text())
        assert content["resolved"] or content["closed_after_s"] is not None


@pytest.mark.parametrize("gone", ["removed", "unwritable"])
def test_a_directory_that_can_no_longer_be_written_keeps_the_watchdog_from_nothing(tmp_path, gone):
    """The actor's directory, where this wait's hang file went, is gone since its engine closed (removed, or its file's
    name taken by a directory: every write there fails): the wait's end is still written where it can be, a removed
    directory is not made again, and the next hang is still found."""
    actor, critic = Engine(), Engine()
    first = watched(actor, tmp_path / "actor")
    second = watched(critic, tmp_path / "critic", name="critic")
    critic_file = tmp_path / "critic" / "hang_rank_0.json"
    assert wait_for(lambda: (tmp_path / "actor" / "hang_rank_0.json").exists() and critic_file.exists(),
                    TIMEOUT_S + 3 * POLL_SECONDS)
    first.close()
    if gone == "removed":
        shutil.rmtree(tmp_path / "actor")
    else:
        (tmp_path / "actor" / "hang_rank_0.json").unlink()
        (tmp_path / "actor" / "hang_rank_0.json").mkdir()

    def stepping_until_resolved():  # (a step a look: no new hang before the resolved file is read)
        critic.train_step()
        time.sleep(0.1)
        return json.loads(critic_file.read_text())["resolved"]

    assert wait_for(stepping_until_resolved, 3 * POLL_SECONDS)
    assert (tmp_path / "actor").exists() == (gone == "unwritable")
    assert wait_for(lambda: not json.loads(critic_file.read_text())["resolved"], TIMEOUT_S + 3 * POLL_SECONDS)
    assert json.loads(critic_file.read_text())["engines"][0]["global_step"] >= 1  # the new hang, after the steps
    second.close()


def test_an_engine_dropped_right_after_its_slow_step_leaves_its_file_resolved(tmp_path):
    """The slow step ended, then the program dropped the engine before the thread's next look: the thread's last look
    has no engine left, and still writes the wait's end where the hang file went."""
    engine = Engine()
    watched(engine, tmp_path)
    path = tmp_path / "hang_rank_0.json"
    assert wait_for(path.exists, TIMEOUT_S + 3 * POLL_SECONDS)
    engine.train_step()
    del engine
    gc.collect()
    assert wait_for(lambda: not watchdog_threads(), 3 * POLL_SECONDS)
    assert json.loads(path.read_text())["resolved"]


def test_attaching_an_engine_while_a_hang_stands_does_not_resolve_it(tmp_path):
    """A hang file stands; the program attaches another engine (no step of any engine ended): still a hang."""
    first = watched(Engine(), tmp_path)
    path = tmp_path / "hang_rank_0.json"
    assert wait_for(path.exists, TIMEOUT_S + 3 * POLL_SECONDS)
    second = watched(Engine(), tmp_path, name="critic")
    time.sleep(2 * POLL_SECONDS)
    assert not json.loads(path.read_text())["resolved"]
    second.close()
    first.close()


def test_a_job_ending_without_close_says_its_waits_end_as_close_would(tmp_path):
    """A script that never calls close() (the docs say close runs at exit too): a slow last step that ended is written
    resolved, a long evaluation after the last step closed_after_s, as an explicit close() would have them."""
    script = f"""
import sys, time
sys.path[:0] = {[str(REPO), str(REPO / "tests")]!r}
from test_hangs import watched, wait_for, TIMEOUT_S, POLL_SECONDS
from test_zero_attach import Engine
from pathlib import Path
engine = Engine()
watched(engine, Path(sys.argv[1]))
engine.train_step()
assert wait_for((Path(sys.argv[1]) / "hang_rank_0.json").exists, TIMEOUT_S + 3 * POLL_SECONDS)
if sys.argv[2] == "slow last step":
    engine.train_step()
"""
    for ending in ("slow last step", "evaluation after it"):
        out = tmp_path / ending.replace(" ", "_")
        done = subprocess.run([sys.executable, "-c", script, str(out), ending], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        content = json.loads((out / "hang_rank_0.json").read_text())
        assert content["resolved"] if ending == "slow last step" else content["closed_after_s"] is not None


def test_a_hang_file_this_process_wrote_stays_at_a_reattach_one_only_naming_its_pid_and_host_goes(tmp_path):
    """A relaunched container has the same pids and host name: a hang file naming them that this process did not
    write is an earlier run's and goes at the attach.  Then a hang, the program catches it and closes (inside its
    except: the file stays a HANG) and attaches a new engine in the same directory (a Trainer resumed in-process):
    that file is this job's evidence, and stays."""
    import os
    import socket

    path = tmp_path / "hang_rank_0.json"
    path.write_text(json.dumps({"schema": 1, "rank": 0, "pid": os.getpid(), "host": socket.gethostname(),
                                "resolved": False, "time": time.time() - 86400}))
    first = watched(Engine(), tmp_path)
    assert not path.exists()
    assert wait_for(path.exists, TIMEOUT_S + 3 * POLL_SECONDS)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        first.close()
    second = watched(Engine(), tmp_path)
    assert path.exists() and not json.loads(path.read_text())["resolved"]
    second.close()