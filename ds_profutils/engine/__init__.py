"""The hub that follows an engine's steps (placeholder: the engine lane's ``__init__`` replaces this one).

:mod:`.flops` counts the model FLOPs of a micro step once per input shape; :mod:`.accelerators`
knows the peak dense TFLOP/s of the usual accelerators, for MFU.
"""
