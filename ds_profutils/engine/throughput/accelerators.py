"""Peak dense TFLOP/s of the usual training accelerators, by the name torch reports and the dtype: MFU's divisor.

MFU (model FLOPs utilisation) is the achieved TFLOP/s of a step over the accelerator's peak.  The
peak comes, in this order, from the config (``step_metrics.peak_tflops``), else from this table of
the vendors' data sheets, else there is none and no MFU is given (:func:`resolve_peak` says which,
once, in a log line).  The figures are dense (the sheets' "with sparsity" figures halved where only
those are printed) and per device as torch sees it: an AMD MI250X or MI250 shows torch two devices
(one per graphics compute die), each with half the card's figure.

``fp32`` is the plain (non-tensor, or AMD's matrix) FP32 figure; an fp32 job whose matmuls run in
TF32 (``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision("high")``)
is held to ``tf32``: :func:`compute_dtype` picks it.  Sources: NVIDIA's data sheets for A100, H100
(SXM, PCIe, NVL), H200 (SXM, NVL), GH200, HGX B200, L40S, L4, A10, A30, T4, V100/V100S; AMD's
product pages for Instinct MI210, MI250, MI250X, MI300X, MI325X.  NVIDIA publishes no sheet for AWS's
A10G: its FP32 figure (31.5, AWS) is the A10's within 1%, so it takes the A10's.  The H800 (China-market
H100) has the H100's compute: the SXM part the H100 SXM's figures, the PCIe part the H100 PCIe's.

Names are matched exactly, not by family: a row's pattern names one part, and a part with a qualifier
(PCIe, NVL) never falls through to the SXM row.  ROCm names the two MI250 cards together ("AMD Instinct
MI250X/MI250"): a name that lists two different rows is ambiguous, so no table figure is taken (the
two differ by 6%) and the log line says to set ``peak_tflops``.

The device name is torch's (:func:`device_name`: ``torch.cuda.get_device_name`` on CUDA and ROCm,
``torch.xpu.get_device_name`` on XPU, the same-named function of the accelerator's torch module
elsewhere), not DeepSpeed's accelerator's, which has no such method in 0.19.  The dtype an engine is
held to is what it computes in (:func:`engine_compute_dtype`): DeepSpeed's ``torch_autocast`` section
makes an fp32 engine compute its matmuls in bf16 or fp16, and then that is the peak.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple, Optional, Set, Tuple

import torch

from ...logging import logger

__all__ = ["ACCELERATORS", "Accelerator", "Peak", "compute_dtype", "device_name", "engine_compute_dtype",
           "find_accelerator", "mfu", "peak_tflops", "resolve_peak"]


class Accelerator(NamedTuple):
    """One row of the table: what it is called, how torch names it, its dense peaks by dtype."""

    name: str
    pattern: str
    """Searched in the device name, upper-cased with ``-`` and ``_`` read as spaces."""
    peaks: Mapping[str, float]


def _row(name: str, pattern: str, bf16: Optional[float], fp16: float, tf32: Optional[float],
         fp32: float) -> Accelerator:
    peaks = {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}
    return Accelerator(name, pattern, {dtype: value for dtype, value in peaks.items() if value is not None})


# Most specific first: "H100 NVL" before the plain "H100" (an SXM part reports "NVIDIA H100 80GB HBM3"); the
# SXM rows also refuse a PCIe or NVL qualifier, so no order mistake can hand a PCIe part the SXM figure.
ACCELERATORS: Tuple[Accelerator, ...] = (
    _row("H100 NVL", r"\bH100\b.*\bNVL\b", 835.5, 835.5, 417.5, 60.0),
    _row("H100 PCIe", r"\bH100\b.*\bPCIE\b", 756.0, 756.0, 378.0, 51.0),
    _row("H800 PCIe", r"\bH800\b.*\bPCIE\b", 756.0, 756.0, 378.0, 51.0),
    _row("H100 SXM", r"\b(H100|H800)\b(?!.*\b(PCIE|NVL)\b)", 989.4, 989.4, 494.7, 67.0),
    _row("GH200", r"\bGH200\b", 989.4, 989.4, 494.7, 67.0),
    _row("H200 NVL", r"\bH200\b.*\bNVL\b", 835.5, 835.5, 417.5, 60.0),
    _row("H200 SXM", r"\bH200\b(?!.*\bNVL\b)", 989.4, 989.4, 494.7, 67.0),
    _row("B200", r"\bB200\b", 2250.0, 2250.0, 1125.0, 75.0),
    _row("A100 PCIe", r"\bA100\b.*\bPCIE\b|\bA800\b.*\bPCIE\b", 312.0, 312.0, 156.0, 19.5),
    _row("A100 SXM", r"\b(A100|A800)\b(?!.*\bPCIE\b)", 312.0, 312.0, 156.0, 19.5),
    _row("A10G", r"\bA10G\b", 125.0, 125.0, 62.5, 31.2),
    _row("A10", r"\bA10\b", 125.0, 125.0, 62.5, 31.2),
    _row("A30", r"\bA30\b", 165.0, 165.0, 82.0, 10.3),
    _row("L40S", r"\bL40S\b", 362.05, 362.05, 183.0, 91.6),
    _row("L4", r"\bL4\b", 121.0, 121.0, 60.0, 30.3),
    _row("T4", r"\bT4\b", None, 65.0, None, 8.1),
    _row("V100S PCIe", r"\bV100S\b", None, 130.0, None, 16.4),
    _row("V100 PCIe", r"\bV100\b.*\bPCIE\b", None, 112.0, None, 14.0),
    _row("V100 SXM2", r"\bV100\b(?!.*\bPCIE\b)", None, 125.0, None, 15.7),
    _row("MI325X", r"\bMI325X\b", 1307.4, 1307.4, 653.7, 163.4),
    _row("MI300X", r"\bMI300X\b", 1307.4, 1307.4, 653.7, 163.4),
    _row("MI250X (one die)", r"\bMI250X\b", 191.5, 191.5, None, 47.9),
    _row("MI250 (one die)", r"\bMI250\b", 181.0, 181.0, None, 45.3),
    _row("MI210", r"\bMI210\b", 181.0, 181.0, None, 45.3),
)

_COMPILED = tuple((re.compile(row.pattern), row) for row in ACCELERATORS)

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}


def _dtype_key(dtype: Any) -> Optional[str]:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"`` as the table's key; None for a dtype it has no column
    for (fp8, fp64)."""
    text = str(dtype).lower()
    return _DTYPE_NAMES.get(text[len("torch."):] if text.startswith("torch.") else text)


def _row_of(normal: str) -> Optional[Accelerator]:
    return next((row for pattern, row in _COMPILED if pattern.search(normal)), None)


def find_accelerator(device_name: Optional[str]) -> Optional[Accelerator]:
    """The table's row for a device name as ``torch.cuda.get_device_name()`` reports it; None for a name the
    table does not know or one that names two parts ("MI250X/MI250", module doc)."""
    if not device_name:
        return None
    rows = {row.name: row for row in map(_row_of, re.sub(r"[-_]", " ", device_name.upper()).split("/")) if row}
    return next(iter(rows.values())) if len(rows) == 1 else None


def device_name(accelerator: Any) -> Optional[str]:
    """The name torch gives the accelerator's current device (the table's key); None on CPU, or where the
    accelerator's torch module has no names (module doc)."""
    kind = accelerator.device_name()
    module = getattr(torch, kind, None) if kind != "cpu" else None
    get_name = getattr(module, "get_device_name", None)
    if get_name is None:
        return None
    try:
        return get_name(accelerator.current_device())
    except Exception:  # noqa: BLE001 - a device torch cannot name: no table figure, a configured peak still counts
        return None


def engine_compute_dtype(engine: Any, dtype: Any) -> Any:
    """The dtype an engine of parameter dtype ``dtype`` computes in: DeepSpeed's ``torch_autocast`` dtype when
    that section is on (``engine.torch_autocast_enabled()``), else :func:`compute_dtype` of ``dtype``."""
    autocast = getattr(engine, "torch_autocast_enabled", None)
    if autocast is not None and autocast():
        return engine.torch_autocast_dtype()
    return compute_dtype(dtype)


def peak_tflops(device_name: Optional[str], dtype: Any) -> Optional[float]:
    """The table's peak dense TFLOP/s of ``device_name`` in ``dtype``; None for an unknown device or a dtype its
    sheet does not list (a V100 has no bf16)."""
    row = find_accelerator(device_name)
    key = _dtype_key(dtype)
    return row.peaks.get(key) if row is not None and key is not None else None


def compute_dtype(dtype: Any) -> Any:
    """The dtype whose peak an engine of ``dtype`` is held to: ``"tf32"`` for fp32 with TF32 matmuls on."""
    if _dtype_key(dtype) != "fp32":
        return dtype
    return "tf32" if torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32 \
        else dtype


class Peak(NamedTuple):
    """The peak MFU is taken against, and where it came from: ``"config"``, ``"table"``, or ``"none"``."""

    tflops: Optional[float]
    source: str
    accelerator: Optional[str]


_said: Set[Tuple[Optional[str], Optional[str]]] = set()


def resolve_peak(configured: Optional[float], device_name: Optional[str], dtype: Any) -> Peak:
    """``step_metrics.peak_tflops`` when set, else the table's figure, else none (no MFU).  A fallback is said
    once per device name and dtype in this process, as an INFO line on DeepSpeed's logger."""
    if configured is not None:
        return Peak(configured, "config", None)
    row = find_accelerator(device_name)
    key = _dtype_key(dtype)
    value = row.peaks.get(key) if row is not None and key is not None else None
    if (device_name, key) not in _said:
        _said.add((device_name, key))
        if value is not None:
            logger.info("ds_profutils: step_metrics.peak_tflops not set; MFU against %s TFLOP/s, the dense %s peak "
                        "of %s on its data sheet (device %r)", value, key, row.name, device_name)
        else:
            known = f"the table's {row.name} lists no {key or dtype} figure" if row is not None else \
                "not in the table of known accelerators"
            logger.info("ds_profutils: no MFU: step_metrics.peak_tflops not set and device %r is %s; set "
                        "step_metrics.peak_tflops to the accelerator's dense peak", device_name, known)
    return Peak(value, "table" if value is not None else "none", row.name if value is not None else None)


def mfu(achieved_tflops: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Achieved TFLOP/s over the peak (a fraction); None without either."""
    if achieved_tflops is None or not peak:
        return None
    return achieved_tflops / peak
