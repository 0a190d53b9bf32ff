"""``deepspeed.utils.types``, DeepSpeed's own: every name reads through to it (see :mod:`._read_through`)."""
from ._read_through import read_through

__getattr__, __dir__, __all__ = read_through("deepspeed.utils.types")
