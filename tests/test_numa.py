"""ds_profutils.numa: DeepSpeed's numactl commands, topology from numactl or sysfs, clear errors."""
import inspect
import os
import random
import stat
import subprocess
import types

import deepspeed.utils.numa as ds_numa
import pytest

import ds_profutils.numa as numa
from ds_profutils.exceptions import InvalidArgumentError
from ds_profutils.numa import (get_numa_cores, get_numactl_cmd, parse_numactl_hardware, parse_range_list,
                               read_sysfs_numa_cores)

NUMACTL_TWO_NODES = """\
available: 2 nodes (0-1)
node 0 cpus: 0 1 2 3 8 9 10 11
node 0 size: 64350 MB
node 0 free: 60211 MB
node 1 cpus: 4 5 6 7 12 13 14 15
node 1 size: 64485 MB
node 1 free: 61000 MB
node distances:
node   0   1
  0:  10  21
  1:  21  10
"""

# Sapphire Rapids with HBM in flat mode: two memory-only nodes, listed with no cpus (and a trailing space).
NUMACTL_FLAT_HBM = """\
available: 4 nodes (0-3)
node 0 cpus: 0 1 2 3
node 0 size: 128000 MB
node 1 cpus: 4 5 6 7
node 1 size: 128000 MB
node 2 cpus: \n\
node 2 size: 16384 MB
node 3 cpus:
node 3 size: 16384 MB
"""

# Node ids with a gap: nodes 0 and 3 only, both with cores (no memory-only node).
NUMACTL_GAP = """\
available: 2 nodes (0,3)
node 0 cpus: 0 1 2 3
node 0 size: 64350 MB
node 3 cpus: 4 5 6 7
node 3 size: 64485 MB
"""

# One socket split in fake NUMA nodes: nodes 0-1 and 2-3 repeat the same cores.
NUMACTL_FAKE = """\
available: 4 nodes (0-3)
node 0 cpus: 0 1 2 3
node 1 cpus: 0 1 2 3
node 2 cpus: 4 5 6 7
node 3 cpus: 4 5 6 7
"""

TOPOLOGIES = {
    "none": [],
    "one node": [list(range(8))],
    "two nodes": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
    "flat hbm": [[0, 1, 2, 3], [4, 5, 6, 7], [], []],
    "fake numa": [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]],
    "fake numa and a plain node": [[0, 1], [0, 1], [2, 3], [4, 5], [4, 5]],
}
CORE_LISTS = [None, "0-7", "0-3,8-11", "4-7,12-15", "0,2,4,6", "0-15", "1-6", "0-2,4-5"]


@pytest.fixture
def quiet_deepspeed(monkeypatch):
    """DeepSpeed's numa module without its dpkg/rpm probing (it prints when numactl is missing)."""
    monkeypatch.setattr(ds_numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)


def test_public_surface_matches_deepspeed():
    for name in ("get_numa_cores", "check_for_numactl_pkg", "parse_range", "parse_range_list", "get_numactl_cmd"):
        assert list(inspect.signature(getattr(numa, name)).parameters) == \
            list(inspect.signature(getattr(ds_numa, name)).parameters), name


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_numactl_cmd_equals_deepspeeds_for_every_rank(monkeypatch, quiet_deepspeed, topology):
    monkeypatch.setattr(ds_numa, "get_numa_cores", lambda: TOPOLOGIES[topology])
    monkeypatch.setattr(numa, "get_numa_cores", lambda: TOPOLOGIES[topology])
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    for core_list in CORE_LISTS:
        for procs in (1, 2, 3, 4):
            for rank in range(procs):
                try:
                    expected = ds_numa.get_numactl_cmd(core_list, procs, rank)
                except AssertionError:  # DeepSpeed's "at least one core per rank"
                    with pytest.raises(InvalidArgumentError, match="at least one core needs to be assigned"):
                        get_numactl_cmd(core_list, procs, rank)
                    continue
                assert get_numactl_cmd(core_list, procs, rank) == expected, (core_list, procs, rank)


def test_numactl_cmd_binds_memory_by_mode(monkeypatch):
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    cases = [
        ("two nodes", "0-15", 4, [["-m", "0"], ["-m", "1"], ["-m", "0"], ["-m", "1"]]),
        ("flat hbm", "0-7", 2, [["-p", "2"], ["-p", "3"]]),
        ("fake numa", "0-7", 2, [["-m", "0,1"], ["-m", "2,3"]]),
        ("two nodes", "2-5", 1, [[]]),  # spans two nodes: no memory binding
    ]
    for topology, core_list, procs, bindings in cases:
        monkeypatch.setattr(numa, "get_numa_cores", lambda topology=topology: TOPOLOGIES[topology])
        for rank, binding in enumerate(bindings):
            cores_per_rank, cmd = get_numactl_cmd(core_list, procs, rank)
            assert cmd[0] == "numactl" and cmd[1:-2] == binding and cmd[-2] == "-C"
            assert len(parse_range_list(cmd[-1])) == cores_per_rank


def test_numactl_cmd_without_numactl_fails_fast_naming_it(monkeypatch):
    # DeepSpeed 0.19.8 returns a command whose first word cannot be started: every rank then fails
    # with "file not found".  Its later releases raise here, as we do.
    monkeypatch.setattr(numa.shutil, "which", lambda name: None)
    with pytest.raises(InvalidArgumentError, match="numactl is not on PATH"):
        get_numactl_cmd("0-3", 2, 0)


@pytest.mark.parametrize("text, expected", [
    (NUMACTL_TWO_NODES, TOPOLOGIES["two nodes"]),
    (NUMACTL_FLAT_HBM, TOPOLOGIES["flat hbm"]),
    (NUMACTL_FAKE, TOPOLOGIES["fake numa"]),
    ("available: 2 nodes (0,2)\nnode 0 cpus: 0 1\nnode 2 cpus: 2 3\n", [[0, 1], [], [2, 3]]),
    ("No NUMA available on this system\n", []),
])
def test_parse_numactl_hardware(text, expected):
    assert parse_numactl_hardware(text) == expected


def test_node_ids_are_the_nodes_the_system_has():
    assert parse_numactl_hardware(NUMACTL_GAP).node_ids == {0, 3}
    assert parse_numactl_hardware(NUMACTL_FLAT_HBM).node_ids == {0, 1, 2, 3}  # 2 and 3: memory-only
    assert parse_numactl_hardware("No NUMA available on this system\n").node_ids == set()


def test_missing_node_ids_are_not_taken_for_memory_only_nodes(monkeypatch):
    topology = parse_numactl_hardware(NUMACTL_GAP)
    assert topology == [[0, 1, 2, 3], [], [], [4, 5, 6, 7]]
    monkeypatch.setattr(numa, "get_numa_cores", lambda: topology)
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    # Not flat HBM (-p 1, -p 2: nodes that do not exist): each rank's memory on its own node.
    assert get_numactl_cmd("0-7", 2, 0) == (4, ["numactl", "-m", "0", "-C", "0-3"])
    assert get_numactl_cmd("0-7", 2, 1) == (4, ["numactl", "-m", "3", "-C", "4-7"])


def test_flat_hbm_with_a_gap_in_node_ids_pairs_the_real_nodes(monkeypatch):
    text = "node 0 cpus: 0 1 2 3\nnode 1 cpus: 4 5 6 7\nnode 4 cpus:\nnode 5 cpus:\n"
    monkeypatch.setattr(numa, "get_numa_cores", lambda: parse_numactl_hardware(text))
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    assert get_numactl_cmd("0-7", 2, 0)[1][1:3] == ["-p", "4"]
    assert get_numactl_cmd("0-7", 2, 1)[1][1:3] == ["-p", "5"]


def test_parse_numactl_hardware_reads_what_deepspeed_reads(monkeypatch):
    for text in (NUMACTL_TWO_NODES, NUMACTL_FAKE):
        fake = types.SimpleNamespace(check_output=lambda cmd, text=text: text.encode(),
                                     SubprocessError=subprocess.SubprocessError)
        monkeypatch.setattr(ds_numa, "subprocess", fake)
        assert parse_numactl_hardware(text) == ds_numa.get_numa_cores()


def make_sysfs(root, cpulists):
    for name, cpulist in cpulists.items():
        (root / name).mkdir()
        (root / name / "cpulist").write_text(cpulist + "\n")
    for other in ("online", "possible", "has_cpu"):
        (root / other).write_text("0-1\n")
    return root


def test_read_sysfs_numa_cores(tmp_path):
    root = make_sysfs(tmp_path, {"node0": "0-3,8-11", "node1": "4-7,12-15", "node2": "", "node10": "16"})
    topology = read_sysfs_numa_cores(root)
    assert topology == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15], []] + [[]] * 7 + [[16]]
    assert topology.node_ids == {0, 1, 2, 10}  # node 2 exists, without cores; 3 to 9 do not
    assert read_sysfs_numa_cores(tmp_path / "missing") == []


def fake_numactl(directory, script):
    path = directory / "numactl"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_get_numa_cores_asks_numactl_and_sysfs_only_without_it(tmp_path, monkeypatch):
    sysfs = tmp_path / "sysfs"
    sysfs.mkdir()
    monkeypatch.setattr(numa, "SYSFS_NODE_DIR", make_sysfs(sysfs, {"node0": "0-1"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    fake_numactl(bin_dir, f"cat <<'EOF'\n{NUMACTL_TWO_NODES}EOF\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert get_numa_cores() == TOPOLOGIES["two nodes"]

    # numactl cannot use NUMA here (a container): -m would fail too, so no topology, as in DeepSpeed.
    fake_numactl(bin_dir, "echo 'No NUMA available on this system' >&2; exit 1\n")
    assert get_numa_cores() == []
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no numactl on this host: sysfs knows
    assert get_numa_cores() == [[0, 1]]

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert get_numa_cores() == [[0, 1]]
    assert numa.check_for_numactl_pkg() is False


def test_real_machine_topology_and_command():
    cores = get_numa_cores()
    if not cores:
        pytest.skip("this machine exposes no NUMA topology (no numactl, no sysfs nodes)")
    flat = [core for node in cores for core in node]
    assert flat and len(flat) == len(set(flat)) and all(isinstance(core, int) for core in flat)
    if numa.shutil.which("numactl") is None:
        assert cores == read_sysfs_numa_cores()
        with pytest.raises(InvalidArgumentError, match="numactl is not on PATH"):
            get_numactl_cmd(None, 1, 0)
        return
    cores_per_rank, cmd = get_numactl_cmd(None, 1, 0)
    assert cmd[0] == "numactl" and cmd[-2] == "-C"
    assert parse_range_list(cmd[-1]) == list(range(cores_per_rank))


@pytest.mark.parametrize("text", ["0", "7", "0-3", "0,2-4,6", "1-1,3", "0-63,128-191", "0-3, 8-11", " 0 - 3,8-11 "])
def test_parse_range_list_equals_deepspeeds(text):
    assert parse_range_list(text) == ds_numa.parse_range_list(text)


def test_format_range_list_round_trips():
    rng = random.Random(4)
    for _ in range(200):
        cores = sorted(rng.sample(range(64), rng.randrange(1, 64)))
        assert parse_range_list(numa._format_range_list(cores)) == cores


@pytest.mark.parametrize("text, message", [
    ("a", r"bad core range 'a': expected a core id such as '4' or an inclusive range such as '0-3'"),
    ("1-", r"bad core range '1-'"),
    ("-1", r"bad core range '-1'"),
    ("1 2", r"bad core range '1 2'"),
    ("1-2-3", r"bad core range '1-2-3'"),
    ("", r"bad core range ''"),
    ("0,,2", r"bad core range '': .*\(in core list '0,,2'\)"),
    ("5-2", r"bad core range '5-2': reversed, the end \(2\) is below the start \(5\); write '2-5'"),
    ("0-3,2", r"bad core list '0-3,2': cores \[2\] are listed twice \(at '2'\)"),
    ("0-3,3-5", r"cores \[3\] are listed twice"),
    ("4,2", r"bad core list '4,2': items must be in ascending order \(at '2'\)"),
])
def test_bad_core_lists_are_rejected_with_the_reason(text, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_range_list(text)


def test_impossible_requests_are_rejected(monkeypatch):
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [])
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    with pytest.raises(InvalidArgumentError, match=r"2 cores in bind_core_list '0-1', fewer than the 3 local"):
        get_numactl_cmd("0-1", 3, 0)
    with pytest.raises(InvalidArgumentError, match=r"local_rank must be within 0\.\.1 for 2 local processes, got 2"):
        get_numactl_cmd("0-3", 2, 2)
    with pytest.raises(InvalidArgumentError, match=r"local_rank must be within"):
        get_numactl_cmd("0-3", 2, -1)
    with pytest.raises(InvalidArgumentError, match=r"num_local_procs must be >= 1, got 0"):
        get_numactl_cmd("0-3", 0, 0)
    with pytest.raises(InvalidArgumentError, match=r"reversed"):
        get_numactl_cmd("3-0", 1, 0)
    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine")
    with pytest.raises(ValueError, match="KMP_AFFINITY conflicts with numactl"):
        get_numactl_cmd("0-3", 1, 0)


def test_missing_numactl_is_logged_with_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    warnings = []
    monkeypatch.setattr(numa.logger, "warning", lambda message, *args: warnings.append(message))
    assert numa.check_for_numactl_pkg() is False
    assert len(warnings) == 1 and "install the numactl package" in warnings[0]
