"""Packaging for ds_profutils: a drop-in fork of ``deepspeed.utils`` plus profiling tools."""
from pathlib import Path

from setuptools import find_packages, setup


def read_version() -> str:
    """Read ``__version__`` without importing the package (importing needs torch)."""
    for line in Path(__file__).with_name("ds_profutils").joinpath("version.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip('"')
    raise RuntimeError("ds_profutils/version.py has no __version__")


setup(
    name="ds-profutils",
    version=read_version(),
    description="A deepspeed.utils-compatible toolkit for profiling DeepSpeed training",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_profutils", "ds_profutils.*"]),
    python_requires=">=3.9",
    # torch is not pinned here: users bring the build that matches their accelerator.
    install_requires=[
        "deepspeed>=0.19,<0.20",
        "torch>=2.1",
        "numpy",  # the timer's reservoir sample (already a DeepSpeed dependency)
        "packaging>=20.0",
        "pydantic>=2.0",
        "hjson",
        "orjson>=3.9",  # the report parses gigabytes of per-rank records; the recorder encodes one per step
    ],
    # The frameworks ds_profutils.attach adapts to (docs/integrations.md), in the release ranges their
    # adapters support (ds_profutils/integrations/dispatch.py; tests/test_integrations.py keeps them equal).
    extras_require={
        "transformers": ["transformers>=5.0,<6", "accelerate>=1.0,<2"],  # the Trainer runs DeepSpeed through Accelerate
        "accelerate": ["accelerate>=1.0,<2"],
        "lightning": ["lightning>=2.0,<3"],
        "test": ["pytest>=7", "pytest-xdist>=3", "matplotlib>=3.5", "transformers>=5.0,<6", "accelerate>=1.0,<2", "lightning>=2.0,<3",
                 "pytorch-lightning>=2.0,<3",
                 "tensorboard>=2.10",  # the live metrics' sink tests read TensorBoard event files back
                 "nvtx>=0.2"],  # the tests take both paths: with and without nvtx
        "plot": ["matplotlib>=3.5"],
        # Not a requirement: with the nvtx package importable, DeepSpeed's CUDA accelerator pushes its
        # ranges into a named NVTX domain instead of torch.cuda.nvtx's default one, so installing it
        # changes what an existing Nsight filter sees.  It also lets ds_profutils ask NVTX whether a
        # tool is attached (without it: the NVTX_INJECTION64_PATH variable, and one warning).
        "nvtx": ["nvtx>=0.2"],
    },
    entry_points={"console_scripts": ["ds-profutils=ds_profutils.cli:main"]},
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
