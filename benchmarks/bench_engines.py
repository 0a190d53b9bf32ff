"""The engine the step benchmarks train, built the one way (imported by the workers they start under the launcher).

A 12-layer MLP of 128-wide linears on 2 gloo ranks, micro batch 8, Adam; each benchmark adds the
ZeRO section and the ds_config sections it measures.  One definition, so the step ratios of
bench_zero_fetch.py, bench_step_metrics.py and bench_live.py are taken on the same model.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

MICRO_BATCH, WIDTH, LAYERS = 8, 128, 12


def mlp_engine(zero_optimization: Dict[str, Any], **sections: Any) -> Tuple[Any, Any, int, Dict[str, Any]]:
    """(engine, a batch, this rank, its ds_config) after ``deepspeed.init_distributed`` on gloo."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero_optimization,
        **sections,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, torch.randn(MICRO_BATCH, WIDTH), torch.distributed.get_rank(), config
