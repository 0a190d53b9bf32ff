"""Trace captures: a torch trace of a few steps on the ranks that matter, asked for while the job trains
(``ds-profutils capture``) or fired by an anomaly the live exchange shows (docs/capture.md).

:mod:`.decide` is what every rank decides from the exchanged rows (torch-free), :mod:`.files` rank 0's
request, manifest and refusal files, :mod:`.hosts` the chosen ranks' hosts for the manifest (through
torch.distributed's store, no collective), :mod:`.tracer` one rank's trace, :mod:`.controller` the glue that
rides on the live interval exchange and follows the engine's steps.  A subpackage so that the engine hub
stays within its module budget.
"""
from .controller import CaptureController, attach_capture
from .decide import COLUMNS, CaptureDecider, Plan, Request

__all__ = ["COLUMNS", "CaptureController", "CaptureDecider", "Plan", "Request", "attach_capture"]
