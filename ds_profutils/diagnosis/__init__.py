"""Why a job is slow and what to change: pure functions of the report's per-engine summary and the recorded
config (no torch, no deepspeed), used by the report, the diff and the live metrics alike.

- :mod:`.causes`: the cause of a straggler's lateness (one decision, its thresholds named).
- :mod:`.stragglers`: work per rank and the causes over a step view.
- :mod:`.advice`: rules from figures to ds_config keys.
- :mod:`.checked`: the diff's check that a change did what the advice said.
- :mod:`.settings`: the engine's effective config values the rules read, as recorded.
"""
