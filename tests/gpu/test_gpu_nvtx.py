"""NVTX on a real GPU: the ``nvtx`` section names the domain of DeepSpeed's own instrumented functions on
DeepSpeed's unpatched CUDA accelerator, and undoing it gives DeepSpeed's domain back.

The ranges are pushed through the ``nvtx`` package's domain objects (the ds-profutils[nvtx] extra), which
this test watches as the accelerator asks for them; without the package the accelerator has no domains
and the test is skipped with that reason.
"""
import deepspeed.accelerator.cuda_accelerator as ds_cuda_accelerator
import pytest

from ds_profutils import nvtx
from test_nvtx import deepspeeds_free_param


class RecordingDomain:
    """An ``nvtx`` package domain that writes each push to ``calls``, then does it."""

    def __init__(self, name, domain, calls):
        self.name, self.domain, self.calls = name, domain, calls

    def push_range(self, message=None, category=None, **kwargs):
        self.calls.append(("push", message, self.name))
        return self.domain.push_range(message=message, category=category, **kwargs)

    def pop_range(self):
        return self.domain.pop_range()


def test_the_section_names_deepspeeds_own_ranges_domain_on_cuda(cuda_accelerator, monkeypatch):
    package = ds_cuda_accelerator.nvtx
    if package is None:
        pytest.skip("the nvtx package is not installed (pip install ds-profutils[nvtx]): the CUDA accelerator "
                    "then pushes into torch.cuda.nvtx's default domain, and a domain does not apply")
    calls = []
    monkeypatch.setattr(cuda_accelerator, "_nvtx_domains", {})
    monkeypatch.setattr(package, "get_domain", lambda name, real=package.get_domain: RecordingDomain(
        name, real(name), calls))
    undo = nvtx.configure_nvtx(enabled=True, domain="MyJob")
    try:
        deepspeeds_free_param()
    finally:
        undo()
    deepspeeds_free_param()
    # DeepSpeed's wrapper pushes, then free_param refuses the stand-in parameter (no pop follows).
    assert calls == [("push", "free_param", "MyJob"), ("push", "free_param", "DeepSpeed")]  # undone: its own again
