"""ResNet-18 as torch.onnx.export writes torchvision's resnet18 in eval mode (opset 17):
BatchNorm folded into each Conv's weights and bias, then Relu, MaxPool, Add,
GlobalAveragePool, Flatten, Gemm. Built here with onnx.helper and random weights from a
seed, at any width and image size, so that the bench needs neither torch nor a 45 MB
file in the repository (tests/fixtures/models/resnet18.onnx is the torch export of the
same architecture at width 16)."""
from __future__ import annotations

from typing import Any

import numpy as np

OPSET = 17


def resnet18_onnx(hw: int = 224, width: int = 64, classes: int = 1000, seed: int = 0,
                  batch: int = 1) -> Any:
    """The model (an onnx.ModelProto, checked); input "input" [batch, 3, hw, hw],
    output "logits" [batch, classes]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    inits: list[Any] = []

    def init(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    def conv(x: str, name: str, cin: int, cout: int, k: int, stride: int, relu: bool,
             gain: float = 2.0) -> str:
        w = rng.standard_normal((cout, cin, k, k)) * np.sqrt(gain / (cin * k * k))
        b = 0.1 * rng.standard_normal(cout)
        p = k // 2
        nodes.append(helper.make_node(
            "Conv", [x, init(f"{name}.weight", w), init(f"{name}.bias", b)], [f"{name}.out"],
            name=f"{name}/Conv", dilations=[1, 1], group=1, kernel_shape=[k, k],
            pads=[p, p, p, p], strides=[stride, stride]))
        if not relu:
            return f"{name}.out"
        nodes.append(helper.make_node("Relu", [f"{name}.out"], [f"{name}.relu"],
                                      name=f"{name}/Relu"))
        return f"{name}.relu"

    x = conv("input", "conv1", 3, width, 7, 2, True)
    nodes.append(helper.make_node("MaxPool", [x], ["maxpool"], name="maxpool/MaxPool",
                                  ceil_mode=0, dilations=[1, 1], kernel_shape=[3, 3],
                                  pads=[1, 1, 1, 1], strides=[2, 2]))
    x, cin = "maxpool", width
    for layer in range(4):
        cout = width << layer
        for block in range(2):
            stride = 2 if layer > 0 and block == 0 else 1
            name = f"layer{layer + 1}.{block}"
            y = conv(x, f"{name}.conv1", cin, cout, 3, stride, True)
            y = conv(y, f"{name}.conv2", cout, cout, 3, 1, False, gain=1.0)
            sc = x if stride == 1 and cin == cout else conv(
                x, f"{name}.downsample", cin, cout, 1, stride, False, gain=1.0)
            nodes.append(helper.make_node("Add", [y, sc], [f"{name}.add"], name=f"{name}/Add"))
            nodes.append(helper.make_node("Relu", [f"{name}.add"], [f"{name}.out"],
                                          name=f"{name}/Relu"))
            x, cin = f"{name}.out", cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"], name="avgpool"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="Flatten", axis=1))
    fc_w = rng.standard_normal((classes, cin)) / np.sqrt(cin)
    nodes.append(helper.make_node("Gemm", ["flat", init("fc.weight", fc_w),
                                           init("fc.bias", 0.1 * rng.standard_normal(classes))],
                                  ["logits"], name="fc/Gemm", alpha=1.0, beta=1.0, transB=1))
    graph = helper.make_graph(
        nodes, "resnet18",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, hw, hw])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="virtaccel-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
