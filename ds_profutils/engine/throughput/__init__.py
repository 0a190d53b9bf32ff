"""Throughput figures of the engine hub: model FLOPs counted from the modules' hooks (:mod:`.flops`) and the
accelerator's dense peak (:mod:`.accelerators`), the two halves of TFLOP/s and MFU.

A subpackage so the hub folder stays small; both modules are leaves (torch and the package logger only).
"""
