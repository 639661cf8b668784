"""The real-model fixture set (tests/fixtures/models/): PyTorch exports, opset 17,
`dynamo=False`, random weights, written by tools/export_models.py. Loading them needs
onnx and numpy only, never torch.

    fx = load("resnet18")
    fx.path                  # the .onnx file
    fx.inputs                # {input name: ndarray}, as `virtaccel run --inputs` takes them
    fx.expected              # {output name: ndarray} recorded from torch at export time
    fx.onnxruntime           # the same from onnxruntime (single-threaded), or None
    rel_err(got, fx.expected["logits"]) <= 1e-4
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MANIFEST = FIXTURES_DIR / "manifest.json"

# The twelve architectures of issue 14's "Done when", by fixture name.
ARCHITECTURES = {
    "mlp": "an MLP",
    "lenet5": "LeNet-5",
    "resnet18": "ResNet-18",
    "resnet50": "ResNet-50",
    "mobilenet_v2": "MobileNetV2",
    "squeezenet1_1": "SqueezeNet 1.1",
    "shufflenet_v2_x0_5": "ShuffleNetV2 x0.5",
    "efficientnet_b0": "EfficientNet-B0",
    "vit_small": "a small VisionTransformer",
    "transformer_encoder_layer": "nn.TransformerEncoderLayer",
    "multihead_attention": "nn.MultiheadAttention",
    "gpt2_decoder": "a 2-block GPT-style decoder with GELU",
}
# The CNNs whose int8 versions must keep cosine similarity >= 0.99 to f32.
CNNS = ("lenet5", "resnet18", "resnet50", "mobilenet_v2", "squeezenet1_1",
        "shufflenet_v2_x0_5", "efficientnet_b0")


@dataclass(frozen=True)
class ModelFixture:
    name: str
    path: Path
    info: dict[str, Any]                 # the manifest's entry
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]      # torch's outputs
    onnxruntime: dict[str, np.ndarray] | None


def manifest() -> dict[str, Any]:
    with open(MANIFEST) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def names() -> list[str]:
    return list(manifest()["models"])


def load(name: str) -> ModelFixture:
    info = manifest()["models"][name]
    with np.load(FIXTURES_DIR / f"{name}.inputs.npz") as z:
        inputs = {k: z[k] for k in z.files}
    with np.load(FIXTURES_DIR / f"{name}.expected.npz") as z:
        rec = {k: z[k] for k in z.files}
    torch_out = {k.split(".", 1)[1]: v for k, v in rec.items() if k.startswith("torch.")}
    ort = {k.split(".", 1)[1]: v for k, v in rec.items() if k.startswith("onnxruntime.")}
    return ModelFixture(name, FIXTURES_DIR / info["file"], info, inputs, torch_out,
                        ort or None)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (the fixtures' tolerance measure, as the exporter's)."""
    ref64 = np.asarray(ref, dtype=np.float64)
    scale = float(np.max(np.abs(ref64))) if ref64.size else 0.0
    diff = np.abs(np.asarray(got, dtype=np.float64) - ref64)
    return float(np.max(diff)) / (scale or 1.0) if diff.size else 0.0
