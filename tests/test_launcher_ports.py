"""The test launcher's ports: two test workers must not pick the same master port."""
import random

from launcher import free_port


def test_free_ports_do_not_follow_the_programs_random_seed():
    """The Trainer seeds Python's ``random`` (``set_seed(42)``) in whichever test worker builds one in-process; two
    workers seeded alike then drew the same ports in the same order, and a job failed its rendezvous with
    EADDRINUSE on the port the other worker's job held."""
    random.seed(42)
    first = [free_port() for _ in range(4)]
    random.seed(42)
    assert [free_port() for _ in range(4)] != first
