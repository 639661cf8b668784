#!/usr/bin/env python3
"""Export the real-model fixture set (tests/fixtures/models/) with torch.

The twelve architectures that issue 14's "Done when" names, exported as a new user would:
`torch.onnx.export(..., opset_version=17, dynamo=False)`, eval mode, random weights from a
fixed seed. There is no torchvision build on the project's machines, so the torchvision
architectures are written here in torch.nn, layer for layer as torchvision defines them
(same modules in the same order, same forward code, so the exported operator set is the
one torchvision's export gives), at reduced width and resolution so that all ONNX files
together stay small (the repository carries them; `make test` needs no torch).

For each model it writes, next to `NAME.onnx`:
- `NAME.inputs.npz`: the fixed input, keyed by graph input name (usable as
  `virtaccel run --inputs` and `virtaccel compile --int8 --calibrate`);
- `NAME.expected.npz`: the outputs recorded at export time, keyed `torch.<output>` and,
  when onnxruntime is installed, `onnxruntime.<output>` (single-threaded);
and `manifest.json` lists every model (shapes, dtypes, parameters, sizes, sha256, what was
reduced from the original). Run from the repository root:

    .venv/bin/pip install torch==2.13.0 onnxruntime   # dev only, never needed by make test
    .venv/bin/python tools/export_models.py [--out DIR] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections import OrderedDict
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

OPSET = 17
SEED = 0
TOTAL_LIMIT = 20 * 1024 * 1024  # bytes of all .onnx files together

# --------------------------------------------------------------------------------------
# Small models


class MLP(nn.Module):
    """A plain multilayer perceptron: Linear / ReLU."""

    def __init__(self, sizes: tuple[int, ...] = (64, 128, 64, 10)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling, as in most tutorials."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# --------------------------------------------------------------------------------------
# torchvision building blocks (torchvision/ops/misc.py, torchvision/models/_utils.py)


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """torchvision.ops.misc.Conv2dNormActivation: Conv2d (no bias with a norm), norm,
    activation; padding (k - 1) // 2 * dilation."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 stride: int = 1, padding: int | None = None, groups: int = 1,
                 norm_layer: Callable[..., nn.Module] | None = nn.BatchNorm2d,
                 activation_layer: Callable[..., nn.Module] | None = nn.ReLU,
                 dilation: int = 1, inplace: bool | None = True) -> None:
        if padding is None:
            padding = (kernel_size - 1) // 2 * dilation
        layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                                             padding, dilation=dilation, groups=groups,
                                             bias=norm_layer is None)]
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation_layer is not None:
            params = {} if inplace is None else {"inplace": inplace}
            layers.append(activation_layer(**params))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.misc.SqueezeExcitation."""

    def __init__(self, input_channels: int, squeeze_channels: int,
                 activation: Callable[..., nn.Module] = nn.ReLU,
                 scale_activation: Callable[..., nn.Module] = nn.Sigmoid) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, input: Tensor) -> Tensor:
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        scale = self.scale_activation(scale)
        return scale * input


class MLPBlockOps(nn.Sequential):
    """torchvision.ops.misc.MLP as ViT's MLPBlock uses it: Linear, GELU, Dropout, Linear,
    Dropout."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(nn.Linear(in_dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(mlp_dim, in_dim), nn.Dropout(dropout))


# --------------------------------------------------------------------------------------
# ResNet (torchvision/models/resnet.py); `width` replaces the fixed 64 of the stem and
# of layer1 (64 is torchvision's), the rest is unchanged.


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1,
            dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation,
                     groups=groups, bias=False, dilation=dilation)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1,
                 base_width: int = 64, dilation: int = 1) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride, groups, dilation)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int],
                 num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.dilation = 1
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int,
                    blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


# --------------------------------------------------------------------------------------
# MobileNetV2 (torchvision/models/mobilenetv2.py)


class MNV2InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = self.stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1,
                                               activation_layer=nn.ReLU6))
        layers.extend([
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim,
                                 activation_layer=nn.ReLU6),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ])
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 round_nearest: int = 8, dropout: float = 0.2) -> None:
        super().__init__()
        input_channel = 32
        last_channel = 1280
        setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
                   [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [Conv2dNormActivation(3, input_channel, stride=2,
                                                          activation_layer=nn.ReLU6)]
        for t, c, n, s in setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(MNV2InvertedResidual(input_channel, output_channel, stride,
                                                     expand_ratio=t))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1,
                                             activation_layer=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout),
                                        nn.Linear(self.last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


# --------------------------------------------------------------------------------------
# SqueezeNet 1.1 (torchvision/models/squeezenet.py)


class Fire(nn.Module):
    def __init__(self, inplanes: int, squeeze_planes: int, expand1x1_planes: int,
                 expand3x3_planes: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze_planes, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze_planes, expand1x1_planes, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze_planes, expand3x3_planes, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet11(nn.Module):
    """SqueezeNet version "1_1"; `w` scales every channel count (1.0 is torchvision's)."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5, w: float = 1.0) -> None:
        super().__init__()
        c = lambda n: max(1, int(n * w))  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, c(64), kernel_size=3, stride=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(c(64), c(16), c(64), c(64)), Fire(c(128), c(16), c(64), c(64)),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(c(128), c(32), c(128), c(128)), Fire(c(256), c(32), c(128), c(128)),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(c(256), c(48), c(192), c(192)), Fire(c(384), c(48), c(192), c(192)),
            Fire(c(384), c(64), c(256), c(256)), Fire(c(512), c(64), c(256), c(256)))
        final_conv = nn.Conv2d(c(512), num_classes, kernel_size=1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), final_conv, nn.ReLU(inplace=True),
                                        nn.AdaptiveAvgPool2d((1, 1)))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.classifier(x)
        return torch.flatten(x, 1)


# --------------------------------------------------------------------------------------
# ShuffleNetV2 (torchvision/models/shufflenetv2.py)


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    x = x.view(batchsize, -1, height, width)
    return x


class ShuffleInvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        branch_features = oup // 2
        if self.stride > 1:
            self.branch1 = nn.Sequential(
                self.depthwise_conv(inp, inp, kernel_size=3, stride=self.stride, padding=1),
                nn.BatchNorm2d(inp),
                nn.Conv2d(inp, branch_features, kernel_size=1, stride=1, padding=0, bias=False),
                nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True))
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if (self.stride > 1) else branch_features, branch_features,
                      kernel_size=1, stride=1, padding=0, bias=False),
            nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True),
            self.depthwise_conv(branch_features, branch_features, kernel_size=3,
                                stride=self.stride, padding=1),
            nn.BatchNorm2d(branch_features),
            nn.Conv2d(branch_features, branch_features, kernel_size=1, stride=1, padding=0,
                      bias=False),
            nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True))

    @staticmethod
    def depthwise_conv(i: int, o: int, kernel_size: int, stride: int = 1, padding: int = 0,
                       bias: bool = False) -> nn.Conv2d:
        return nn.Conv2d(i, o, kernel_size, stride, padding, bias=bias, groups=i)

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        out = channel_shuffle(out, 2)
        return out


class ShuffleNetV2(nn.Module):
    def __init__(self, stages_repeats: list[int], stages_out_channels: list[int],
                 num_classes: int = 1000) -> None:
        super().__init__()
        self._stage_out_channels = stages_out_channels
        input_channels = 3
        output_channels = self._stage_out_channels[0]
        self.conv1 = nn.Sequential(
            nn.Conv2d(input_channels, output_channels, 3, 2, 1, bias=False),
            nn.BatchNorm2d(output_channels), nn.ReLU(inplace=True))
        input_channels = output_channels
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.stage2: nn.Sequential
        self.stage3: nn.Sequential
        self.stage4: nn.Sequential
        stage_names = [f"stage{i}" for i in [2, 3, 4]]
        for name, repeats, output_channels in zip(stage_names, stages_repeats,
                                                  self._stage_out_channels[1:]):
            seq = [ShuffleInvertedResidual(input_channels, output_channels, 2)]
            for _ in range(repeats - 1):
                seq.append(ShuffleInvertedResidual(output_channels, output_channels, 1))
            setattr(self, name, nn.Sequential(*seq))
            input_channels = output_channels
        output_channels = self._stage_out_channels[-1]
        self.conv5 = nn.Sequential(
            nn.Conv2d(input_channels, output_channels, 1, 1, 0, bias=False),
            nn.BatchNorm2d(output_channels), nn.ReLU(inplace=True))
        self.fc = nn.Linear(output_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.maxpool(x)
        x = self.stage2(x)
        x = self.stage3(x)
        x = self.stage4(x)
        x = self.conv5(x)
        x = x.mean([2, 3])
        x = self.fc(x)
        return x


# --------------------------------------------------------------------------------------
# EfficientNet-B0 (torchvision/models/efficientnet.py); stochastic depth is the identity
# in eval mode, so StochasticDepth is left out (it exports nothing).


class MBConvConfig:
    def __init__(self, expand_ratio: float, kernel: int, stride: int, input_channels: int,
                 out_channels: int, num_layers: int, width_mult: float,
                 depth_mult: float) -> None:
        self.expand_ratio = expand_ratio
        self.kernel = kernel
        self.stride = stride
        self.input_channels = self.adjust_channels(input_channels, width_mult)
        self.out_channels = self.adjust_channels(out_channels, width_mult)
        self.num_layers = int(math.ceil(num_layers * depth_mult))

    @staticmethod
    def adjust_channels(channels: int, width_mult: float, min_value: int | None = None) -> int:
        return _make_divisible(channels * width_mult, 8, min_value)


class MBConv(nn.Module):
    def __init__(self, cnf: MBConvConfig, norm_layer: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.use_res_connect = cnf.stride == 1 and cnf.input_channels == cnf.out_channels
        layers: list[nn.Module] = []
        activation_layer = nn.SiLU
        expanded_channels = cnf.adjust_channels(cnf.input_channels, cnf.expand_ratio)
        if expanded_channels != cnf.input_channels:
            layers.append(Conv2dNormActivation(cnf.input_channels, expanded_channels,
                                               kernel_size=1, norm_layer=norm_layer,
                                               activation_layer=activation_layer))
        layers.append(Conv2dNormActivation(expanded_channels, expanded_channels,
                                           kernel_size=cnf.kernel, stride=cnf.stride,
                                           groups=expanded_channels, norm_layer=norm_layer,
                                           activation_layer=activation_layer))
        squeeze_channels = max(1, cnf.input_channels // 4)
        layers.append(SqueezeExcitation(expanded_channels, squeeze_channels,
                                        activation=partial(nn.SiLU, inplace=True)))
        layers.append(Conv2dNormActivation(expanded_channels, cnf.out_channels, kernel_size=1,
                                           norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.out_channels = cnf.out_channels

    def forward(self, input: Tensor) -> Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result += input
        return result


class EfficientNet(nn.Module):
    def __init__(self, width_mult: float = 1.0, depth_mult: float = 1.0,
                 dropout: float = 0.2, num_classes: int = 1000) -> None:
        super().__init__()
        bneck = partial(MBConvConfig, width_mult=width_mult, depth_mult=depth_mult)
        setting = [bneck(1, 3, 1, 32, 16, 1), bneck(6, 3, 2, 16, 24, 2),
                   bneck(6, 5, 2, 24, 40, 2), bneck(6, 3, 2, 40, 80, 3),
                   bneck(6, 5, 1, 80, 112, 3), bneck(6, 5, 2, 112, 192, 4),
                   bneck(6, 3, 1, 192, 320, 1)]
        norm_layer = nn.BatchNorm2d
        layers: list[nn.Module] = []
        firstconv_output_channels = setting[0].input_channels
        layers.append(Conv2dNormActivation(3, firstconv_output_channels, kernel_size=3,
                                           stride=2, norm_layer=norm_layer,
                                           activation_layer=nn.SiLU))
        for cnf in setting:
            stage: list[nn.Module] = []
            for _ in range(cnf.num_layers):
                block_cnf = MBConvConfig.__new__(MBConvConfig)
                block_cnf.__dict__.update(cnf.__dict__)
                if stage:
                    block_cnf.input_channels = block_cnf.out_channels
                    block_cnf.stride = 1
                stage.append(MBConv(block_cnf, norm_layer))
            layers.append(nn.Sequential(*stage))
        lastconv_input_channels = setting[-1].out_channels
        lastconv_output_channels = 4 * lastconv_input_channels
        layers.append(Conv2dNormActivation(lastconv_input_channels, lastconv_output_channels,
                                           kernel_size=1, norm_layer=norm_layer,
                                           activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True),
                                        nn.Linear(lastconv_output_channels, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                init_range = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -init_range, init_range)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


# --------------------------------------------------------------------------------------
# VisionTransformer (torchvision/models/vision_transformer.py), without the optional
# conv stem and representation layer (torchvision's defaults).


class EncoderBlock(nn.Module):
    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float,
                 attention_dropout: float,
                 norm_layer: Callable[..., nn.Module] = partial(nn.LayerNorm, eps=1e-6)) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = norm_layer(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads,
                                                    dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = norm_layer(hidden_dim)
        self.mlp = MLPBlockOps(hidden_dim, mlp_dim, dropout)

    def forward(self, input: Tensor) -> Tensor:
        torch._assert(input.dim() == 3,
                      f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class Encoder(nn.Module):
    def __init__(self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, dropout: float, attention_dropout: float,
                 norm_layer: Callable[..., nn.Module] = partial(nn.LayerNorm, eps=1e-6)) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(
            torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout,
                                                        attention_dropout, norm_layer)
        self.layers = nn.Sequential(layers)
        self.ln = norm_layer(hidden_dim)

    def forward(self, input: Tensor) -> Tensor:
        torch._assert(input.dim() == 3,
                      f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}")
        input = input + self.pos_embedding
        return self.ln(self.layers(self.dropout(input)))


class VisionTransformer(nn.Module):
    def __init__(self, image_size: int, patch_size: int, num_layers: int, num_heads: int,
                 hidden_dim: int, mlp_dim: int, dropout: float = 0.0,
                 attention_dropout: float = 0.0, num_classes: int = 1000) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_length += 1
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout,
                               attention_dropout)
        self.seq_length = seq_length
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))
        fan_in = self.conv_proj.in_channels * self.conv_proj.kernel_size[0] * \
            self.conv_proj.kernel_size[1]
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        assert self.conv_proj.bias is not None
        nn.init.zeros_(self.conv_proj.bias)
        # torchvision zero-initializes the head and the class token; random weights here,
        # or the recorded outputs would not depend on the model at all.
        nn.init.normal_(self.heads.head.weight, std=0.1)
        nn.init.normal_(self.heads.head.bias, std=0.1)
        nn.init.normal_(self.class_token, std=0.02)

    def _process_input(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        p = self.patch_size
        torch._assert(h == self.image_size, f"Wrong image height! Expected {self.image_size}")
        torch._assert(w == self.image_size, f"Wrong image width! Expected {self.image_size}")
        n_h = h // p
        n_w = w // p
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, n_h * n_w)
        x = x.permute(0, 2, 1)
        return x

    def forward(self, x: Tensor) -> Tensor:
        x = self._process_input(x)
        n = x.shape[0]
        batch_class_token = self.class_token.expand(n, -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = self.encoder(x)
        x = x[:, 0]
        x = self.heads(x)
        return x


# --------------------------------------------------------------------------------------
# torch.nn transformer modules and a GPT-style decoder


class MHA(nn.Module):
    """nn.MultiheadAttention called as a user would: query, key, value; both outputs
    (the attention output and the head-averaged weights)."""

    def __init__(self, embed_dim: int = 64, num_heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        out, weights = self.attn(query, key, value)
        return out, weights


class EncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer called on one tensor. (Given the layer itself,
    torch.onnx.export fills its optional forward arguments in from the signature and
    passes `is_causal=False` as a tensor, which the layer refuses.)"""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=d_model, nhead=nhead,
                                                dim_feedforward=dim_feedforward, dropout=0.0)

    def forward(self, src: Tensor) -> Tensor:
        return self.layer(src)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-norm blocks, causal mask, GELU MLP), token ids in,
    logits out."""

    def __init__(self, vocab_size: int = 128, block_size: int = 16, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([GPTBlock(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


# --------------------------------------------------------------------------------------
# The fixture set


class Spec:
    """One fixture: how to build the module and its input, and what was reduced."""

    def __init__(self, name: str, build: Callable[[], nn.Module],
                 inputs: dict[str, Callable[[np.random.Generator], np.ndarray]],
                 outputs: list[str], reduced: str, image: bool = False) -> None:
        self.name = name
        self.build = build
        self.inputs = inputs
        self.outputs = outputs
        self.reduced = reduced
        self.image = image


def _normal(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape).astype(np.float32)


def _tokens(vocab: int, *shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.integers(0, vocab, size=shape, dtype=np.int64)


SPECS = [
    Spec("mlp", lambda: MLP((64, 128, 64, 10)), {"input": _normal(4, 64)}, ["logits"],
         "none (64-128-64-10, batch 4)"),
    Spec("lenet5", lambda: LeNet5(10), {"input": _normal(2, 1, 28, 28)}, ["logits"],
         "none (1x28x28, batch 2)"),
    Spec("resnet18", lambda: ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10, width=16),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "width 16 (torchvision 64), 64x64 input, 10 classes", image=True),
    Spec("resnet50", lambda: ResNet(Bottleneck, [3, 4, 6, 3], num_classes=10, width=8),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "width 8 (torchvision 64), 64x64 input, 10 classes", image=True),
    Spec("mobilenet_v2", lambda: MobileNetV2(num_classes=10, width_mult=0.5),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "width_mult 0.5, 64x64 input, 10 classes", image=True),
    Spec("squeezenet1_1", lambda: SqueezeNet11(num_classes=10, w=0.5),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "channels x0.5, 64x64 input, 10 classes", image=True),
    Spec("shufflenet_v2_x0_5",
         lambda: ShuffleNetV2([4, 8, 4], [24, 48, 96, 192, 1024], num_classes=10),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "x0.5 as torchvision, 64x64 input, 10 classes", image=True),
    Spec("efficientnet_b0", lambda: EfficientNet(width_mult=0.5, num_classes=10),
         {"input": _normal(1, 3, 64, 64)}, ["logits"],
         "B0 depth, width_mult 0.5, 64x64 input, 10 classes", image=True),
    Spec("vit_small",
         lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                   hidden_dim=64, mlp_dim=128, num_classes=10),
         {"input": _normal(2, 3, 32, 32)}, ["logits"],
         "32x32 image, patch 8, 2 layers, 4 heads, hidden 64, mlp 128, 10 classes"),
    Spec("transformer_encoder_layer",
         lambda: EncoderLayer(d_model=64, nhead=4, dim_feedforward=128),
         {"src": _normal(8, 2, 64)}, ["output"],
         "d_model 64, 4 heads, feed-forward 128; (seq 8, batch 2, 64)"),
    Spec("multihead_attention", lambda: MHA(64, 4),
         {"query": _normal(6, 2, 64), "key": _normal(10, 2, 64), "value": _normal(10, 2, 64)},
         ["attn_output", "attn_weights"],
         "embed 64, 4 heads; query (6, 2, 64), key/value (10, 2, 64)"),
    Spec("gpt2_decoder",
         lambda: GPT(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64),
         {"idx": _tokens(128, 2, 8)}, ["logits"],
         "2 blocks, 4 heads, embed 64, vocab 128, context 16; tokens (2, 8)"),
]


def _calibrate_batchnorm(model: nn.Module, shape: tuple[int, ...], seed: int) -> None:
    """Give every BatchNorm random affine parameters and running statistics measured on
    random images, so that eval mode normalizes for real (fresh BN statistics, mean 0 and
    variance 1, would let activations grow with depth) and BN folding is not trivial."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    if not bns:
        return
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for bn in bns:
            bn.weight.copy_(1 + 0.1 * torch.randn(bn.weight.shape, generator=gen))
            bn.bias.copy_(0.1 * torch.randn(bn.bias.shape, generator=gen))
            bn.reset_running_stats()
            bn.momentum = None  # a cumulative average over the calibration batches
        model.train()
        for _ in range(4):
            model(torch.randn((4, *shape[1:]), generator=gen))
    model.eval()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|: the tolerance measure of the fixture tests."""
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / (scale or 1.0)


def export(spec: Spec, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = spec.build()
    rng = np.random.default_rng(SEED)
    feeds = {name: make(rng) for name, make in spec.inputs.items()}
    if spec.image:
        _calibrate_batchnorm(model, next(iter(feeds.values())).shape, SEED)
    model.eval()
    args = tuple(torch.from_numpy(a) for a in feeds.values())
    with torch.no_grad():
        got = model(*args)
    outs = got if isinstance(got, tuple) else (got,)
    torch_out = {n: t.numpy().astype(np.float32) for n, t in zip(spec.outputs, outs)}
    path = os.path.join(out_dir, f"{spec.name}.onnx")
    torch.onnx.export(model, args, path, opset_version=OPSET, dynamo=False,
                      input_names=list(spec.inputs), output_names=spec.outputs)
    np.savez(os.path.join(out_dir, f"{spec.name}.inputs.npz"), **feeds)
    expected = {f"torch.{n}": a for n, a in torch_out.items()}
    ort_err: float | None = None
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        res = sess.run(spec.outputs, feeds)
        ort_err = 0.0
        for n, a in zip(spec.outputs, res):
            expected[f"onnxruntime.{n}"] = np.asarray(a, dtype=np.float32)
            ort_err = max(ort_err, _rel_err(np.asarray(a), torch_out[n]))
        if ort_err > 1e-4:
            raise SystemExit(f"{spec.name}: onnxruntime differs from torch by {ort_err:.3g}")
    np.savez(os.path.join(out_dir, f"{spec.name}.expected.npz"), **expected)
    import onnx
    m = onnx.load(path)
    ops: dict[str, int] = {}
    for node in m.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return {
        "file": f"{spec.name}.onnx",
        "bytes": os.path.getsize(path),
        "sha256": _sha256(path),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "reduced": spec.reduced,
        "inputs": {n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in feeds.items()},
        "outputs": {n: {"shape": list(a.shape), "dtype": str(a.dtype)}
                    for n, a in torch_out.items()},
        "nodes": len(m.graph.node),
        "ops": dict(sorted(ops.items())),
        "onnxruntime_vs_torch": ort_err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "models"))
    ap.add_argument("--only", nargs="*", default=None, help="fixture names to (re)export")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    manifest_path = os.path.join(a.out, "manifest.json")
    manifest: dict[str, Any] = {}
    if a.only and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    names = {s.name for s in SPECS}
    for n in a.only or []:
        if n not in names:
            ap.error(f"--only {n}: no such fixture (have {', '.join(sorted(names))})")
    torch.backends.mha.set_fastpath_enabled(False)  # the exported graph, not a fused kernel
    models = dict(manifest.get("models", {}))
    for spec in SPECS:
        if a.only and spec.name not in a.only:
            continue
        info = export(spec, a.out)
        models[spec.name] = info
        print(f"{spec.name:28s} {info['bytes'] / 1e6:6.2f} MB  {info['nodes']:4d} nodes  "
              f"ort-vs-torch {info['onnxruntime_vs_torch']}", file=sys.stderr)
    total = sum(m["bytes"] for m in models.values())
    if total > TOTAL_LIMIT:
        raise SystemExit(f"fixtures total {total} bytes, over the {TOTAL_LIMIT} limit")
    manifest = {"opset": OPSET, "seed": SEED, "torch": torch.__version__,
                "exporter": "torch.onnx.export(dynamo=False)", "total_bytes": total,
                "tolerance": "max|got - ref| / max|ref|",
                "models": {s.name: models[s.name] for s in SPECS if s.name in models}}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"total {total / 1e6:.2f} MB in {len(models)} models -> {manifest_path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
