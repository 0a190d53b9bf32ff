"""``deepspeed.utils.zero_to_torch``, DeepSpeed's own: every name reads through to it (see :mod:`._read_through`), and
``python -m ds_profutils.zero_to_torch`` runs its command line."""
from ._read_through import read_through, run_as_main

__getattr__, __dir__, __all__ = read_through("deepspeed.utils.zero_to_torch")

if __name__ == "__main__":
    run_as_main("deepspeed.utils.zero_to_torch")
