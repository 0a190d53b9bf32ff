"""Placeholder until our own implementation lands: DeepSpeed's, re-exported."""
from deepspeed.utils.numa import *  # noqa
from deepspeed.utils.numa import get_numactl_cmd
