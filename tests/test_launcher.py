"""The test launcher's own rules: two test workers never pick the same master port, and a node whose ranks all
reached the job's end passes with gloo's teardown abort after it, never otherwise."""
import random
import subprocess
import sys

import pytest

from launcher import TEARDOWN_ABORT, _wait_for_nodes, free_port


def test_free_ports_do_not_follow_the_programs_random_seed():
    """The Trainer seeds Python's ``random`` (``set_seed(42)``) in whichever test worker builds one in-process; two
    workers seeded alike then drew the same ports in the same order, and a job failed its rendezvous with
    EADDRINUSE on the port the other worker's job held."""
    random.seed(42)
    first = [free_port() for _ in range(4)]
    random.seed(42)
    assert [free_port() for _ in range(4)] != first


@pytest.mark.parametrize("before_abort, passes", [
    ("print('job end: rank 0', flush=True)", True),
    ("print('Traceback (most recent call last):', flush=True); print('job end: rank 0', flush=True)", False),
    ("pass", False),  # died before its end
])
def test_a_node_passes_with_the_teardown_abort_only_after_its_ranks_reached_the_end(tmp_path, before_abort, passes):
    log = open(tmp_path / "node_0.log", "w")
    script = f"import os, sys; {before_abort}; print({TEARDOWN_ABORT!r}, file=sys.stderr, flush=True); os.abort()"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    failures = _wait_for_nodes([(process, log)], tmp_path, timeout=60, ranks_per_node=1)
    assert (failures == []) is passes, failures
