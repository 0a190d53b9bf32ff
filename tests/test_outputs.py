"""Process identity under every launcher, read when files are named; per-rank and per-engine file names."""
import os
import socket

import pytest

from ds_profutils import outputs
from ds_profutils.outputs import (MAIN_ENGINE, ProcessIdentity, atomic_path, fetch_records_file, fetch_records_files,
                                  probe_writable, process_identity, trace_file, trace_files)

# conftest.clean_env removes every launcher's variables: each test sets those of the launcher it plays.


@pytest.mark.parametrize("launcher, expected", [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (5, 8, 1, "RANK")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     (3, 4, 1, "OMPI_COMM_WORLD_RANK")),
    ({"PMI_RANK": "2", "PMI_SIZE": "6"}, (2, 6, 0, "PMI_RANK")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, (7, 16, 3, "SLURM_PROCID")),
    # PMIx has no size variable: the size comes from any launcher that set one (srun under PMIx sets SLURM's)
    ({"PMIX_RANK": "9", "SLURM_NTASKS": "12", "SLURM_LOCALID": "1"}, (9, 12, 1, "PMIX_RANK")),
    ({"PMIX_RANK": "9"}, (9, 10, 0, "PMIX_RANK")),  # the least world holding the rank
    ({"WORLD_SIZE": "4"}, (0, 4, 0, "default (no launcher variables)")),
    ({}, (0, 1, 0, "default (no launcher variables)")),
])
def test_identity_from_each_launchers_variables(monkeypatch, launcher, expected):
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    identity = process_identity()
    assert (identity.rank, identity.world_size, identity.local_rank, identity.source) == expected
    assert (identity.host, identity.pid) == (socket.gethostname(), os.getpid())


def test_identity_is_read_when_asked_not_at_import(monkeypatch):
    """mpirun sets its variables before Python starts, but torch.distributed comes up later: a decorator
    applied at import must not have fixed the rank."""
    before = process_identity()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    after = process_identity()
    assert (before.rank, before.world_size) == (0, 1) and (after.rank, after.world_size) == (1, 2)


def test_temp_and_probe_names_carry_host_rank_and_pid(tmp_path, monkeypatch):
    """Ranks on several hosts (or containers) may share a directory, and pids repeat across them."""
    identity = ProcessIdentity(rank=3, world_size=4, local_rank=1, host="node-b", pid=77, source="test")
    made = []
    real_write = outputs.Path.write_bytes
    monkeypatch.setattr(outputs.Path, "write_bytes", lambda self, data: (made.append(self.name),
                                                                         real_write(self, data))[1])
    probe_writable(tmp_path / "out", identity)
    assert made == [".write_probe.node-b.3.77"] and list((tmp_path / "out").iterdir()) == []
    destination = tmp_path / "trace_rank_3.json"
    with atomic_path(destination, identity) as temporary:
        assert temporary.name == ".trace_rank_3.json.node-b.3.77.tmp"
        temporary.write_text("{}")
    assert destination.read_text() == "{}" and not temporary.exists()


def test_a_failed_write_leaves_no_temporary_and_no_destination(tmp_path):
    destination = tmp_path / "summary_rank_0.txt"
    with pytest.raises(RuntimeError):
        with atomic_path(destination) as temporary:
            temporary.write_text("half")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_file_names_by_rank_and_engine_parse_back(tmp_path):
    names = [
        fetch_records_file(tmp_path, 0),
        fetch_records_file(tmp_path, 1),
        fetch_records_file(tmp_path, 0, "critic"),
        fetch_records_file(tmp_path, 12, "engine1"),
        trace_file(tmp_path, 0),
        trace_file(tmp_path, 3),
    ]
    assert [path.name for path in names] == [
        "zero_fetch_rank_0.jsonl", "zero_fetch_rank_1.jsonl", "zero_fetch_critic_rank_0.jsonl",
        "zero_fetch_engine1_rank_12.jsonl", "trace_rank_0.json", "trace_rank_3.json"
    ]
    for path in names:
        path.touch()
    (tmp_path / "zero_fetch_rank_x.jsonl").touch()  # not ours
    assert fetch_records_files(tmp_path) == {
        "critic": {0: names[2]},
        "engine1": {12: names[3]},
        MAIN_ENGINE: {0: names[0], 1: names[1]},
    }
    assert trace_files(tmp_path) == {0: names[4], 3: names[5]}
