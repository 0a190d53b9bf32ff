"""``OnDevice``: build modules directly on a device (or ``meta``) in a given dtype.

It patches torch's tensor constructors, process-wide state, so it is DeepSpeed's class; this subclass
checks the arguments up front instead of failing deep inside the first constructor call.
"""
from typing import Optional, Union

import torch
from deepspeed.utils.init_on_device import OnDevice as _DeepSpeedOnDevice

from ._validate import require_type
from .exceptions import InvalidArgumentError

__all__ = ["OnDevice"]


class OnDevice(_DeepSpeedOnDevice):
    """``with OnDevice(dtype=torch.float16, device="meta"): model = MyModel()``.

    ``isinstance(x, deepspeed.utils.OnDevice)`` still holds.
    """

    def __init__(self, dtype: Optional[torch.dtype], device: Union[None, str, int, torch.device] = "meta",
                 enabled: bool = True) -> None:
        if enabled:  # a disabled OnDevice patches nothing and may be given anything, as in DeepSpeed
            self._check_arguments(dtype, device)
        super().__init__(dtype, device=device, enabled=enabled)

    @staticmethod
    def _check_arguments(dtype: Optional[torch.dtype], device: Union[None, str, int, torch.device]) -> None:
        """None is DeepSpeed's too: no dtype keeps each tensor's own, no device builds on the default one."""
        if dtype is not None:
            require_type("OnDevice", "dtype", dtype, torch.dtype)
        if device is None:
            return
        require_type("OnDevice", "device", device, (str, int, torch.device))
        if isinstance(device, int):  # an accelerator index, as get_accelerator().current_device() gives
            if device < 0:
                raise InvalidArgumentError(f"OnDevice: device index must be >= 0, got {device}")
            return
        try:
            torch.device(device)
        except RuntimeError as error:
            raise InvalidArgumentError(f"OnDevice: device {device!r} is not a torch device ({error})") from None
