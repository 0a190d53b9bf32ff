"""``python -m ds_profutils ...``: the same command as the ``ds-profutils`` console script."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
