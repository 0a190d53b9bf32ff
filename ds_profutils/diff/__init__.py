"""``ds-profutils diff BASE NEW``: what changed between two runs, engine by engine.

Each run is read by the report's own readers (:mod:`ds_profutils.report`: this package imports it,
never the reverse) and reduced by :mod:`.summary` to what is compared; :mod:`.stats` decides whether a
figure changed beyond run-to-run noise, :mod:`.settings` what the runs were set up with, :mod:`.ops`
the operators' self time in their traces; :mod:`.build` assembles the comparison, :mod:`.text` and
:mod:`.plot` show it, :mod:`.command` is the subcommand.  No torch, DeepSpeed or pydantic.
"""
from .build import build_diff
from .text import render_diff

__all__ = ["build_diff", "render_diff"]
