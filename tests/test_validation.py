"""Bad input to the delegating modules fails with a clear InvalidArgumentError, never silently."""
import numpy
import pytest
import torch

import ds_profutils
from ds_profutils.exceptions import InvalidArgumentError


class Block(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


def test_warning_once_warns_once_at_the_callers_line_and_takes_stacklevel(ds_caplog):
    from ds_profutils.logging import warning_once

    def helper(message):
        warning_once(message, stacklevel=3)  # as DeepSpeed code passes it: point at helper's caller

    for _ in range(2):
        warning_once("ds_profutils test: once")
    helper("ds_profutils test: stacklevel")
    records = [r for r in ds_caplog.records if r.getMessage().startswith("ds_profutils test:")]
    assert [r.getMessage() for r in records] == ["ds_profutils test: once", "ds_profutils test: stacklevel"]
    assert all(r.pathname == __file__ for r in records)
    test_name = "test_warning_once_warns_once_at_the_callers_line_and_takes_stacklevel"
    assert records[0].funcName == records[1].funcName == test_name


def test_error_class_is_value_and_assertion_error():
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(InvalidArgumentError, AssertionError)


def test_leaf_flags_are_deepspeeds_flags():
    import deepspeed.utils as ds_utils
    model = Block()
    found = ds_profutils.set_z3_leaf_modules(model, [torch.nn.Sequential])
    assert found == [model.inner]
    assert ds_utils.z3_leaf_module(model.inner) and ds_utils.get_z3_leaf_modules(model) == [model.inner]
    ds_profutils.unset_z3_leaf_modules(model, ["Sequential"])
    assert not ds_utils.z3_leaf_module(model.inner)
    matched, missing = ds_profutils.set_z3_leaf_modules_by_name(model, ["inner.0", "nope"], raise_if_not_found=False)
    assert matched == [model.inner[0]] and missing == ["nope"]
    matched, _ = ds_profutils.set_z3_leaf_modules_by_suffix(model, [".1"])
    assert matched == [model.inner[1]]
    # Any iterable works, as in DeepSpeed: a generator is read once, not consumed by the check.
    matched, missing = ds_profutils.set_z3_leaf_modules_by_name(model, (name for name in ["inner"]))
    assert matched == [model.inner] and missing == []


@pytest.mark.parametrize("call, match", [
    (lambda m: ds_profutils.set_z3_leaf_modules("model", [torch.nn.Linear]), "model must be Module"),
    (lambda m: ds_profutils.set_z3_leaf_modules(m, torch.nn.Linear), "leaf_module_classes must be a list"),
    (lambda m: ds_profutils.set_z3_leaf_modules(m, [3]), "every item of leaf_module_classes"),
    (lambda m: ds_profutils.set_z3_leaf_modules_by_name(m, "inner"), "module_names must be a list"),
    (lambda m: ds_profutils.set_z3_leaf_module(m, "yes"), "flag must be bool"),
])
def test_leaf_bad_input(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call(Block())


def test_zero3_only_accessor_on_plain_param():
    param = torch.nn.Parameter(torch.ones(3))
    for accessor in (ds_profutils.safe_get_local_fp32_param, ds_profutils.safe_get_local_grad):
        with pytest.raises(InvalidArgumentError, match="only defined for ZeRO-3"):
            accessor(param)
    with pytest.raises(AssertionError):  # DeepSpeed-era handlers still catch it
        ds_profutils.safe_set_local_fp32_param(param, torch.ones(3))


def test_getters_on_unmanaged_param_return_none_like_deepspeed():
    param = torch.nn.Parameter(torch.ones(3))
    assert ds_profutils.safe_get_full_fp32_param(param) is None
    assert ds_profutils.safe_get_full_optimizer_state(param, "exp_avg") is None


@pytest.mark.parametrize("call, match", [
    (lambda p: ds_profutils.safe_set_full_fp32_param(p, torch.ones(3)), "not managed by a DeepSpeed"),
    (lambda p: ds_profutils.safe_get_full_fp32_param([1, 2]), "param must be Tensor"),
    (lambda p: ds_profutils.safe_get_full_optimizer_state(p, 0), "optim_state_key must be str"),
    (lambda p: ds_profutils.safe_set_full_grad(p, torch.ones(4)), "value has 4 elements but the full parameter has 3"),
    (lambda p: ds_profutils.safe_set_full_grad(p, "0.5"), "value must be Tensor"),
    (lambda p: ds_profutils.safe_update_full_grad_vectorized(p, abs), "param_list must be an iterable"),
    (lambda p: ds_profutils.safe_update_full_grad_vectorized([p], None), "update_func must be callable"),
])
def test_accessor_bad_input(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call(torch.nn.Parameter(torch.ones(3)))


def test_vectorized_update_takes_any_iterable_and_checks_before_changing_anything():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    ds_profutils.safe_update_full_grad_vectorized((p for p in [param]), lambda grad, p: grad * 10)
    assert torch.equal(param.grad, torch.full((3, ), 10.0))
    with pytest.raises(InvalidArgumentError, match="param must be Tensor"):
        ds_profutils.safe_update_full_grad_vectorized([param, "x"], lambda grad, p: grad * 10)
    assert torch.equal(param.grad, torch.full((3, ), 10.0))


def test_safe_set_full_grad_on_local_grad_copies():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.zeros(3)
    ds_profutils.safe_set_full_grad(param, torch.full((3, ), 2.0))
    assert torch.equal(param.grad, torch.full((3, ), 2.0))
    ds_profutils.safe_set_full_grad(param, torch.tensor(5.0))  # broadcast, as DeepSpeed's copy_ does
    assert torch.equal(param.grad, torch.full((3, ), 5.0))
    with pytest.raises(InvalidArgumentError, match=r"value of shape \(2,\) does not broadcast to the gradient's"):
        ds_profutils.safe_set_full_grad(param, torch.ones(2))


def test_on_device_validates_then_builds_on_meta():
    with pytest.raises(InvalidArgumentError, match="dtype must be dtype"):
        ds_profutils.OnDevice(dtype="fp16")
    with pytest.raises(InvalidArgumentError, match="not a torch device"):
        ds_profutils.OnDevice(dtype=torch.float16, device="gpu-ish")
    ds_profutils.OnDevice(dtype=torch.float16, device=0)  # an accelerator index, as current_device() gives
    ds_profutils.OnDevice(dtype=None, enabled=False)  # disabled: nothing is patched, nothing to check (as DeepSpeed)
    with ds_profutils.OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    # As DeepSpeed's: no dtype keeps each tensor's own, no device the default one
    with ds_profutils.OnDevice(dtype=None, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float32
    with ds_profutils.OnDevice(torch.float16, device=None):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float16


def test_recursive_attr_helpers():
    model = Block()
    assert ds_profutils.recursive_getattr(model, "inner.0.weight") is model.inner[0].weight
    replacement = torch.nn.Identity()
    ds_profutils.recursive_setattr(model, "inner.1", replacement)
    assert model.inner[1] is replacement
    with pytest.raises(AttributeError, match="'inner' has no attribute 'missing'"):
        ds_profutils.recursive_getattr(model, "inner.missing.weight")


def test_group_setters_validate_and_reach_deepspeed():
    from deepspeed.utils import groups as ds_groups
    with pytest.raises(InvalidArgumentError, match="world_size must be >= 1"):
        ds_profutils.set_tensor_model_parallel_world_size(0)
    with pytest.raises(InvalidArgumentError, match="rank must be int or NoneType"):
        ds_profutils.set_tensor_model_parallel_rank("0")
    with pytest.raises(InvalidArgumentError, match="rank must be int or NoneType"):
        ds_profutils.set_tensor_model_parallel_rank(True)
    ds_profutils.set_tensor_model_parallel_world_size(4)
    ds_profutils.set_tensor_model_parallel_rank(numpy.int64(3))
    try:
        assert ds_groups.get_tensor_model_parallel_world_size() == 4
        assert ds_profutils.get_tensor_model_parallel_rank() == 3
        assert type(ds_groups._MPU_TENSOR_MODEL_PARALLEL_RANK) is int
    finally:
        # None clears the override, as in DeepSpeed (the getters then ask the process group).
        ds_profutils.set_tensor_model_parallel_world_size(None)
        ds_profutils.set_tensor_model_parallel_rank(None)
    assert ds_groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None and ds_groups._MPU_TENSOR_MODEL_PARALLEL_RANK is None


def test_groups_initialize_is_deprecated_like_deepspeed():
    with pytest.raises(ds_profutils.DeprecatedException):
        ds_profutils.initialize(ep_size=2)


def test_ensure_divisibility_names_a_zero_denominator_and_keeps_deepspeeds_assert():
    from ds_profutils.groups import _ensure_divisibility
    with pytest.raises(InvalidArgumentError, match="denominator must be non-zero"):
        _ensure_divisibility(8, 0)
    with pytest.raises(AssertionError, match="6 is not divisible by 4"):
        _ensure_divisibility(6, 4)
    _ensure_divisibility(8, 4)
    _ensure_divisibility(0, 4)


class _TensorParallelUnit:
    """An mpu in one of the three spellings DeepSpeed reads (rank 3 of 8, group "tp")."""

    def __init__(self, spelling: str):
        for what, value in (("rank", 3), ("world_size", 8), ("group", "tp")):
            setattr(self, f"get_{spelling}_{what}", lambda value=value: value)


@pytest.mark.parametrize("spelling", ["tensor_model_parallel", "slice_parallel", "model_parallel"])
def test_bwc_reads_every_tensor_parallel_spelling_as_deepspeed_does(spelling):
    from deepspeed.utils import bwc as ds_bwc

    from ds_profutils import bwc
    mpu = _TensorParallelUnit(spelling)
    for what in ("rank", "world_size", "group"):
        ours = getattr(bwc, f"bwc_tensor_model_parallel_{what}")(mpu)
        assert ours == getattr(ds_bwc, f"bwc_tensor_model_parallel_{what}")(mpu) == {"rank": 3, "world_size": 8,
                                                                                   "group": "tp"}[what]


@pytest.mark.parametrize("mpu", [None, _TensorParallelUnit("sequence_parallel")], ids=["none", "sequence-parallel"])
def test_bwc_reads_an_mpu_without_tensor_parallelism_as_not_split(mpu):
    # Ulysses' unit has sequence-parallel queries only; DeepSpeed 0.19.8 raises AttributeError here.
    from ds_profutils import bwc
    assert bwc.bwc_tensor_model_parallel_rank(mpu) == 0
    assert bwc.bwc_tensor_model_parallel_world_size(mpu) == 1
    assert bwc.bwc_tensor_model_parallel_group(mpu) is None
