"""The ONNX backend node tests for every operator the VA-1 compiler claims.

onnx's runner generates the node cases from its case modules. A case is included when
every operator in its model is claimed (`supported_ops()`); the cases below are left
out, each for a stated reason that narrows the claim (dtypes the ISA does not have,
training-mode BatchNorm, empty or dynamic shapes, non-tensor values, per-axis or
non-int8 quantization). Counts are printed at the end of the run (conftest).
"""
from __future__ import annotations

import re
import warnings

import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

import onnx.backend.test  # noqa: E402
from onnx.backend.test.loader import load_model_tests  # noqa: E402

from userspace_runtime.onnx_import import supported_ops  # noqa: E402
from virtaccel import onnx_backend  # noqa: E402

_DTYPE = "element types the ISA does not compute in (elementwise is float-only; " \
         "no uint*, int16, int64, bool, float8/4, int4/2)"
EXCLUDED: dict[str, str] = {
    **{f"test_{op}_{t}": _DTYPE for op in ("add", "sub", "mul", "div")
       for t in ("int8", "int16", "uint8", "uint16", "uint32", "uint64")},
    "test_div_int32_trunc": _DTYPE,
    "test_reduce_min_bool_inputs": _DTYPE,
    **{n: _DTYPE for n in (
        "test_dequantizelinear", "test_dequantizelinear_e4m3fn",
        "test_dequantizelinear_e4m3fn_float16", "test_dequantizelinear_e4m3fn_zero_point",
        "test_dequantizelinear_e5m2", "test_dequantizelinear_uint16",
        "test_dequantizelinear_int16", "test_dequantizelinear_uint4",
        "test_dequantizelinear_int4", "test_dequantizelinear_uint2",
        "test_dequantizelinear_int2", "test_dequantizelinear_float4e2m1",
        "test_quantizelinear", "test_quantizelinear_e4m3fn", "test_quantizelinear_e5m2",
        "test_quantizelinear_uint16", "test_quantizelinear_int16", "test_quantizelinear_uint4",
        "test_quantizelinear_int4", "test_quantizelinear_uint2", "test_quantizelinear_int2",
        "test_quantizelinear_float4e2m1", "test_reduce_max_bool_inputs")},
    **{n: "per-axis or blocked quantization (per-tensor int8 only)" for n in (
        "test_dequantizelinear_axis", "test_dequantizelinear_blocked",
        "test_quantizelinear_axis", "test_quantizelinear_blocked_asymmetric",
        "test_quantizelinear_blocked_symmetric")},
    "test_batchnorm_example_training_mode": "training-mode BatchNormalization",
    "test_batchnorm_epsilon_training_mode": "training-mode BatchNormalization",
    **{n: "empty tensors / dynamic shapes (the compiler needs static, non-empty shapes)"
       for n in ("test_reduce_max_empty_set", "test_reduce_min_empty_set", "test_reduce_max_empty_set_bool",
                 "test_reduce_sum_empty_set", "test_reduce_sum_empty_set_non_reduced_axis_zero",
                 "test_reduce_sum_square_empty_set_expanded",
                 "test_reshape_allowzero_reordered")},
    **{f"test_{op}_{t}": _DTYPE for op in ("max", "min")
       for t in ("float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64")},
    **{n: _DTYPE for n in (
        "test_clip_default_int8_max", "test_clip_default_int8_min", "test_maxpool_2d_uint8",
        "test_range_bfloat16_type_positive_delta", "test_where_long_example",
        *(f"test_pow_types_{t}" for t in (
            "float32_int32", "float32_int64", "float32_uint32", "float32_uint64",
            "int32_float32", "int32_int32", "int64_float32", "int64_int64")))},
    **{n: "1-D and 3-D pooling (POOL2D pools NCHW images)" for n in (
        "test_averagepool_1d_default", "test_averagepool_3d_default",
        "test_averagepool_3d_dilations_small", "test_maxpool_1d_default",
        "test_maxpool_3d_default", "test_maxpool_3d_dilations",
        "test_maxpool_3d_dilations_use_ref_impl", "test_maxpool_3d_dilations_use_ref_impl_large",
        *(f"test_averagepool_3d_dilations_large_count_include_pad_is_{i}_ceil_mode_is_{c}"
          for i in (0, 1) for c in ("False", "True")))},
    **{n: "MaxPool's Indices output (argmax positions)" for n in (
        "test_maxpool_with_argmax_2d_precomputed_pads",
        "test_maxpool_with_argmax_2d_precomputed_strides")},

    **{n: "empty tensors (a zero-size shape, slice or split part)" for n in (
        "test_constantofshape_int_shape_zero", "test_slice_start_out_of_bounds",
        "test_shape_start_greater_than_end",
        "test_split_zero_size_splits_opset13", "test_split_zero_size_splits_opset18",
        "test_reduce_l1_empty_set_expanded", "test_reduce_log_sum_empty_set_expanded")},
    **{n: "1-D convolution (CONV2D convolves NCHW images)" for n in (
        "test_causal_conv_with_state_decode_step_expanded",
        "test_causal_conv_with_state_with_bias_and_past_state_expanded",
        "test_causal_conv_with_state_with_past_state_expanded")},
    **{n: "integer arithmetic on a shape given at run time (ELEMENTWISE computes floats; "
          "shapes must be compile-time values)" for n in (
        "test_center_crop_pad_crop_and_pad_expanded",
        "test_center_crop_pad_crop_axes_chw_expanded",
        "test_center_crop_pad_crop_axes_hwc_expanded", "test_center_crop_pad_crop_expanded",
        "test_center_crop_pad_crop_negative_axes_hwc_expanded",
        "test_center_crop_pad_pad_expanded")},
    **{f"test_{op}_{t}{x}": _DTYPE
       for op in ("equal", "less", "greater", "less_equal", "greater_equal")
       for t in ("int16", "uint8", "uint16", "uint32", "uint64") for x in ("", "_expanded")},
    "test_equal_string": "string tensors (numbers only)",
    "test_equal_string_broadcast": "string tensors (numbers only)",
    "test_identity_sequence": "sequence values (tensors only)",
    "test_identity_opt": "optional values (tensors only)",
}


def _claimed_cases() -> list[str]:
    ops = set(supported_ops())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    return sorted(c.name for c in cases
                  if {n.op_type for n in c.model.graph.node} <= ops and c.name not in EXCLUDED)


CLAIMED_CASES = _claimed_cases()

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    backend_test = onnx.backend.test.BackendTest(onnx_backend, __name__)
for _name in CLAIMED_CASES:
    backend_test.include(rf"^{re.escape(_name)}_cpu$")



_wanted = {f"{n}_cpu" for n in CLAIMED_CASES}
for _name, _cls in backend_test.test_cases.items():
    # The runner adds every other case of onnx as a skipped test; keep only ours so the
    # run's counts are about the claimed operators.
    for _attr in [a for a in vars(_cls) if a.startswith("test_") and a not in _wanted]:
        delattr(_cls, _attr)
    if any(a.startswith("test_") for a in vars(_cls)):
        globals()[_name] = _cls


def test_every_claimed_operator_has_node_cases() -> None:
    """Each claimed operator is exercised by at least one node case, except the ones
    whose node cases all use dtypes left out above (covered by model tests instead)."""
    ops = set(supported_ops())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {c.name: c for c in load_model_tests(kind="node")}
    covered = {n.op_type for name in CLAIMED_CASES for n in cases[name].model.graph.node}
    assert ops - covered <= {"QuantizeLinear", "DequantizeLinear"}, ops - covered
    assert len(CLAIMED_CASES) >= 100
