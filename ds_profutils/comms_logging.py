"""Placeholder until our own implementation lands: DeepSpeed's, re-exported."""
from deepspeed.utils.comms_logging import *  # noqa
from deepspeed.utils.comms_logging import get_caller_func
