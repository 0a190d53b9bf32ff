"""Throughput figures of the engine hub: model FLOPs counted from the modules' hooks (:mod:`.flops`, with what a
counting window counts and how in :mod:`.counting` and the inputs' shape key in :mod:`.batch`), the accelerator's
name and dense peak (:mod:`.accelerators`), the two halves of TFLOP/s and MFU, and one optimizer step's totals
over its micro steps, the whole iteration and its gap included (:mod:`.totals`).

A subpackage so the hub folder stays within its module budget; its modules are leaves (torch, the package logger
and the hub's output walk only).
"""
