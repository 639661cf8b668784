"""Small models the compiler tests build: MLP, CNN, transformer encoder block."""
from __future__ import annotations

import numpy as np

from userspace_runtime.compiler import Graph, Value

F32 = np.float32


def _w(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    s = scale if scale is not None else 1.0 / np.sqrt(fan_in)
    return (rng.standard_normal(shape) * s).astype(F32)


def mlp(seed: int = 0, batch: int = 4, sizes: tuple[int, ...] = (16, 32, 8)) -> Graph:
    """x -> (matmul + bias + relu) * n -> logits (no activation at the end)."""
    rng = np.random.default_rng(seed)
    g = Graph("mlp")
    h: Value = g.input("x", (batch, sizes[0]))
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        h = g.add(g.matmul(h, g.constant(_w(rng, a, b).T.copy().T, name=f"w{i}")),
                  g.constant((rng.standard_normal(b) * 0.1).astype(F32), name=f"b{i}"))
        if i < len(sizes) - 2:
            h = g.relu(h)
    g.output(h, names=["logits"])
    return g


def cnn(seed: int = 0, batch: int = 2, channels: tuple[int, int] = (3, 8), hw: int = 8,
        classes: int = 5) -> Graph:
    """conv(3x3, pad 1) -> batchnorm -> relu -> conv(3x3, stride 2) -> relu -> flatten
    -> gemm."""
    rng = np.random.default_rng(seed)
    c0, c1 = channels
    g = Graph("cnn")
    x = g.input("image", (batch, c0, hw, hw))
    y = g.conv2d(x, g.constant(_w(rng, c1, c0, 3, 3)), g.constant(_w(rng, c1, scale=0.1)),
                 padding=(1, 1, 1, 1))
    y = g.batchnorm(y, g.constant((1 + 0.1 * rng.standard_normal(c1)).astype(F32)),
                    g.constant((0.1 * rng.standard_normal(c1)).astype(F32)),
                    g.constant((0.1 * rng.standard_normal(c1)).astype(F32)),
                    g.constant((1 + 0.2 * rng.random(c1)).astype(F32)))
    y = g.relu(y)
    y = g.relu(g.conv2d(y, g.constant(_w(rng, c1, c1, 3, 3)), stride=(2, 2)))
    n = y.shape[1] * y.shape[2] * y.shape[3]
    y = g.reshape(y, (batch, n))
    y = g.gemm(y, g.constant(_w(rng, classes, n)), g.constant(_w(rng, classes, scale=0.1)),
               trans_b=True)
    g.output(y, names=["logits"])
    return g


def encoder_block(seed: int = 0, seq: int = 8, d: int = 16, heads: int = 2,
                  ff: int = 32) -> Graph:
    """Post-norm transformer encoder block: multi-head self-attention (matmul, softmax),
    residual add + layernorm, feed-forward with gelu, residual add + layernorm."""
    rng = np.random.default_rng(seed)
    dh = d // heads
    g = Graph("encoder")
    x = g.input("x", (seq, d))

    def proj(v: Value, n_out: int, name: str) -> Value:
        return g.add(g.matmul(v, g.constant(_w(rng, v.shape[-1], n_out), name=f"{name}_w")),
                     g.constant((0.1 * rng.standard_normal(n_out)).astype(F32),
                                name=f"{name}_b"))

    def heads_first(v: Value) -> Value:           # [S, D] -> [H, S, dh]
        return g.transpose(g.reshape(v, (seq, heads, dh)), (1, 0, 2))

    q, k, v = (heads_first(proj(x, d, n)) for n in ("q", "k", "v"))
    kt = g.transpose(k, (0, 2, 1))                 # [H, dh, S]
    scores = g.mul(g.matmul(q, kt), g.constant(np.array(1 / np.sqrt(dh), F32)))
    attn = g.softmax(scores, -1)
    ctx = g.reshape(g.transpose(g.matmul(attn, v), (1, 0, 2)), (seq, d))
    x1 = g.layernorm(g.add(x, proj(ctx, d, "o")), g.constant(np.ones(d, F32) * 1.1),
                     g.constant(np.full(d, 0.05, F32)))
    f = proj(g.gelu(proj(x1, ff, "ff1")), d, "ff2")
    y = g.layernorm(g.add(x1, f), g.constant(np.ones(d, F32)), g.constant(np.zeros(d, F32)))
    g.output(y, names=["y"])
    return g


def resnet_stage(seed: int = 0, hw: int = 56, c: int = 64, classes: int = 10,
                 stem: bool = True) -> Graph:
    """ResNet-18-shaped convolutions (no pooling ops): [a 7x7 stride-2 stem from 3
    channels] -> a basic block at c x hw x hw (two 3x3 convs + batchnorm, residual
    add, relu) -> a downsampling block (3x3 stride 2 to 2c, 1x1 stride-2 shortcut) ->
    global mean -> gemm."""
    rng = np.random.default_rng(seed)
    g = Graph("resnet_stage")

    def conv_bn(x: Value, cin: int, cout: int, k: int, stride: int, relu: bool) -> Value:
        p = k // 2
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(F32)
        y = g.conv2d(x, g.constant(w), stride=(stride, stride), padding=(p, p, p, p))
        y = g.batchnorm(y, g.constant((1 + 0.1 * rng.standard_normal(cout)).astype(F32)),
                        g.constant((0.1 * rng.standard_normal(cout)).astype(F32)),
                        g.constant((0.1 * rng.standard_normal(cout)).astype(F32)),
                        g.constant((1 + 0.2 * rng.random(cout)).astype(F32)))
        return g.relu(y) if relu else y

    if stem:
        x0 = g.input("image", (1, 3, 2 * hw, 2 * hw))
        x = conv_bn(x0, 3, c, 7, 2, True)
    else:
        x = g.input("image", (1, c, hw, hw))
    y = conv_bn(conv_bn(x, c, c, 3, 1, True), c, c, 3, 1, False)
    x = g.relu(g.add(y, x))
    y = conv_bn(conv_bn(x, c, 2 * c, 3, 2, True), 2 * c, 2 * c, 3, 1, False)
    x = g.relu(g.add(y, conv_bn(x, c, 2 * c, 1, 2, False)))
    x = g.reshape(g.reduce(x, "mean", (2, 3), keepdims=False), (1, 2 * c))
    g.output(g.gemm(x, g.constant(_w(rng, 2 * c, classes)), g.constant(_w(rng, classes,
                                                                            scale=0.1))),
             names=["logits"])
    return g
