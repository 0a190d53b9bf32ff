"""The parts of ``ds_profutils.timer`` (DeepSpeed's ``deepspeed.utils.timer`` surface, which stays the one
public module): :mod:`.host` the host-clock timer, :mod:`.events` the device-event timer, :mod:`.throughput`
the throughput timer.  A private package rather than private modules at the top, which holds the mirror of
``deepspeed.utils``: the three serve one public module and are read together.
"""
