"""The lent card's dense peak is found in the table, by the name torch gives it, through DeepSpeed's accelerator."""
import torch
from deepspeed.accelerator import get_accelerator

from ds_profutils.engine.throughput.accelerators import device_name, resolve_peak


def test_the_lent_cards_peak_is_found():
    name = device_name(get_accelerator())
    assert name == torch.cuda.get_device_name(torch.cuda.current_device())
    peak = resolve_peak(None, name, torch.bfloat16)
    assert peak.source == "table" and peak.tflops > 0, f"no table figure for {name!r}"
