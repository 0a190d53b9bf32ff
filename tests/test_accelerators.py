"""The peak TFLOP/s table: device names as torch reports them, dtypes, and the config > table > none order."""
import pytest
import torch

from ds_profutils.engine.throughput import accelerators
from ds_profutils.engine.throughput.accelerators import (compute_dtype, device_name, engine_compute_dtype,
                                                         find_accelerator, mfu, peak_tflops, resolve_peak)


@pytest.mark.parametrize("device, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H800", "H100 SXM"),
    ("NVIDIA H800 PCIe", "H800 PCIe"),  # the PCIe part's compute, not the SXM row's
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
    ("AMD Instinct MI300X", "MI300X"),
    ("AMD Instinct MI325X", "MI325X"),
    ("AMD Instinct MI250X", "MI250X (one die)"),
    ("AMD Instinct MI250", "MI250 (one die)"),
    ("AMD Instinct MI210", "MI210"),
    ("nvidia h100 pcie", "H100 PCIe"),  # any case
])
def test_device_names_as_torch_reports_them(device, row):
    assert find_accelerator(device).name == row


@pytest.mark.parametrize("device", ["NVIDIA L40", "NVIDIA GeForce RTX 4090", "AMD Instinct MI300A", "NVIDIA A1000",
                                    "NVIDIA H20", "cpu", "", None,
                                    "AMD Instinct MI250X/MI250", "AMD Instinct MI250X / MI250"])
def test_unknown_names_match_nothing(device):
    """Unknown parts, and ROCm's one name for two parts 6% apart (MI250X and MI250): no figure is guessed."""
    assert find_accelerator(device) is None
    assert peak_tflops(device, torch.bfloat16) is None


def test_dense_figures_by_dtype():
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp16") == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 494.7
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float32) == 67.0
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0  # not the 624 "with sparsity"
    assert peak_tflops("AMD Instinct MI300X", torch.bfloat16) == 1307.4
    assert peak_tflops("Tesla V100-SXM2-16GB", torch.float16) == 125.0
    assert peak_tflops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # its sheet lists no bf16
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float64) is None  # no column for it
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn) is None


def test_every_row_is_dense_and_ordered_sensibly():
    for row in accelerators.ACCELERATORS:
        assert row.peaks["fp16"] >= row.peaks["fp32"] > 0, row.name
        assert row.peaks.get("bf16", row.peaks["fp16"]) == row.peaks["fp16"], row.name
        if "tf32" in row.peaks:
            assert row.peaks["fp16"] / 2 == pytest.approx(row.peaks["tf32"], rel=0.02), row.name


def test_config_wins_then_the_table_then_none_each_said_once(ds_caplog, monkeypatch):
    monkeypatch.setattr(accelerators, "_said", set())
    assert resolve_peak(400.0, "NVIDIA H100 80GB HBM3", torch.bfloat16) == (400.0, "config", None)
    assert not ds_caplog.records  # the config's own figure needs no word
    for _ in range(2):
        assert resolve_peak(None, "NVIDIA H100 80GB HBM3", torch.bfloat16) == (989.4, "table", "H100 SXM")
        assert resolve_peak(None, "NVIDIA GeForce RTX 4090", torch.bfloat16) == (None, "none", None)
        assert resolve_peak(None, "Tesla V100-SXM2-16GB", torch.bfloat16) == (None, "none", None)
    lines = [record.getMessage() for record in ds_caplog.records]
    assert len(lines) == 3
    assert "989.4 TFLOP/s, the dense bf16 peak of H100 SXM" in lines[0]
    assert "no MFU" in lines[1] and "not in the table" in lines[1] and "step_metrics.peak_tflops" in lines[1]
    assert "V100 SXM2 lists no bf16 figure" in lines[2]


def test_fp32_with_tf32_matmuls_is_held_to_tf32():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype(torch.float32) is torch.float32
        torch.set_float32_matmul_precision("high")
        assert compute_dtype(torch.float32) == "tf32"
        assert compute_dtype(torch.bfloat16) is torch.bfloat16
    finally:
        torch.set_float32_matmul_precision(before)


def test_mfu_is_achieved_over_peak():
    assert mfu(494.7, 989.4) == pytest.approx(0.5)
    assert mfu(100.0, None) is None and mfu(None, 989.4) is None


def test_h800_pcie_is_held_to_the_pcie_figure():
    assert peak_tflops("NVIDIA H800 PCIe", torch.bfloat16) == 756.0
    assert peak_tflops("NVIDIA H800", torch.bfloat16) == 989.4


def test_device_name_is_torchs_name_of_the_current_cuda_device(monkeypatch):
    """DeepSpeed 0.19's CUDA accelerator (also ROCm's) has no get_device_name: the name comes from torch."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: asked.append(index) or "NVIDIA H100 PCIe")
    assert device_name(CUDA_Accelerator()) == "NVIDIA H100 PCIe" and asked == [3]
    assert resolve_peak(None, device_name(CUDA_Accelerator()), torch.bfloat16).tflops == 756.0


def test_device_name_is_none_on_cpu_and_where_torch_has_no_names():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class Nameless:  # an accelerator kind whose torch module has no get_device_name
        def device_name(self):
            return "mps"

        def current_device(self):
            return 0

    assert device_name(CPU_Accelerator()) is None and device_name(Nameless()) is None


class _Engine:
    """The two methods DeepSpeed 0.19's engine answers the ``torch_autocast`` section with."""

    def __init__(self, enabled, dtype=None):
        self.enabled, self.dtype = enabled, dtype

    def torch_autocast_enabled(self):
        return self.enabled

    def torch_autocast_dtype(self):
        return self.dtype


def test_an_fp32_engine_under_torch_autocast_is_held_to_the_autocast_peak():
    assert engine_compute_dtype(_Engine(True, torch.bfloat16), torch.float32) is torch.bfloat16
    assert peak_tflops("NVIDIA H100 80GB HBM3", engine_compute_dtype(_Engine(True, torch.bfloat16),
                                                                      torch.float32)) == 989.4
    assert engine_compute_dtype(_Engine(False), torch.bfloat16) is torch.bfloat16
    assert engine_compute_dtype(object(), torch.bfloat16) is torch.bfloat16  # an engine without the section


def test_deepspeed_exposes_torch_autocast_as_the_engine_reads_it():
    """The config key as DeepSpeed 0.19 parses it: what ``torch_autocast_enabled/_dtype`` return."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"enabled": True,
                                                                                       "dtype": "bfloat16"}},
                             mpu=None, mesh_device=None)
    assert config.torch_autocast_enabled and config.torch_autocast_dtype == torch.bfloat16
