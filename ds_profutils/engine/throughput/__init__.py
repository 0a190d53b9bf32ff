"""Throughput figures of the engine hub: model FLOPs counted from the modules' hooks (:mod:`.flops`), the
accelerator's dense peak (:mod:`.accelerators`), the two halves of TFLOP/s and MFU, and one optimizer
step's totals over its micro steps, the whole iteration and its gap included (:mod:`.totals`).

A subpackage so the hub folder stays within its module budget; its modules are leaves (torch and the
package logger only).
"""
