"""ProfilerSchedule's windows are torch.profiler.schedule's actions, step for step."""
import itertools
import warnings

import pytest
from torch.profiler import ProfilerAction, schedule

from ds_profutils.exceptions import InvalidArgumentError
from ds_profutils.torch_profiler.schedule import ProfilerSchedule


def _actions_from_windows(plan: ProfilerSchedule, steps: int) -> list:
    """What torch would do at each step, derived from our windows."""
    actions = [ProfilerAction.NONE] * steps
    cycle = 0
    while (window := plan.window(cycle)) is not None and window.warmup_start < steps:
        for step in range(window.warmup_start, min(window.stop, steps)):
            if step < window.active_start:
                actions[step] = ProfilerAction.WARMUP
            elif step < window.stop - 1:
                actions[step] = ProfilerAction.RECORD
            else:
                actions[step] = ProfilerAction.RECORD_AND_SAVE
        cycle += 1
    return actions


@pytest.mark.parametrize("skip_first,wait,warmup,active,repeat",
                         list(itertools.product([0, 2], [0, 1, 3], [0, 2], [1, 3], [0, 1, 2])))
def test_windows_match_torch_schedule(skip_first, wait, warmup, active, repeat):
    steps = 60
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about warmup=0
        torch_schedule = schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    ours = ProfilerSchedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    assert _actions_from_windows(ours, steps) == [torch_schedule(step) for step in range(steps)]


def test_repeat_bounds_the_windows():
    plan = ProfilerSchedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    assert [plan.window(c) is not None for c in range(3)] == [True, True, False]
    assert (plan.window(1).warmup_start, plan.window(1).active_start, plan.window(1).stop) == (6, 7, 9)


def test_every_bad_value_is_named():
    with pytest.raises(InvalidArgumentError, match=r"wait=-1 \(need an int >= 0\), active=0 \(need an int >= 1\)"):
        ProfilerSchedule(wait=-1, active=0)
    with pytest.raises(AssertionError, match="repeat=True"):  # also an AssertionError, as DeepSpeed raised
        ProfilerSchedule(repeat=True)
