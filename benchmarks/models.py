"""The models `train_step.py` times, written here after torchvision's published
architectures (torchvision's wheel does not load on every machine this runs on; no
code of it is copied). Only the layers are followed: weights start from torch.nn's
default initialization, not torchvision's.

    MODELS[name](classes=...)   the model, in training mode
    input_shape(name, batch, size, frames)   its input's shape (defaults per model)
    classes(name)               its number of output classes (torchvision's)

resnet18      ResNet-18: a 7x7 stride-2 stem, max pooling, four stages of two basic
              blocks (two 3x3 convolutions) with 1x1 stride-2 projections, widths
              64, 128, 256, 512; `width` and `blocks` scale it (the only model they do)
resnet50      ResNet-50 v1.5: bottleneck blocks (1x1, 3x3, 1x1 with 4x expansion),
              3, 4, 6, 3 per stage, the stride on the 3x3
resnext50     ResNeXt-50 32x4d: ResNet-50 with grouped 3x3 convolutions, 32 groups of
              4 channels per 64 of the stage's base width
mobilenet_v2  MobileNetV2 (width 1.0): inverted residuals (1x1 expansion, depthwise 3x3,
              1x1 projection), ReLU6
efficientnet_b0  EfficientNet-B0-like: MBConv blocks with depthwise 3x3 and 5x5
              convolutions and squeeze-excitation (two 1x1 Conv2d on the pooled tensor,
              as torchvision), SiLU, BatchNorm (eps 1e-3); stochastic depth and the
              classifier's dropout are left out (both random, and neither touches a
              convolution)
r3d_18        R3D-18: the 3-D ResNet-18 for video (Conv3d 3->64 stem, kernel (3, 7, 7),
              stride (1, 2, 2); basic blocks of 3x3x3 convolutions, BatchNorm3d; 400
              classes as Kinetics-400)

MobileNetV2's dropout is left out as EfficientNet's. The parameter counts are
torchvision's: 11.69M, 25.56M, 25.03M, 3.50M, 5.29M and 33.37M in the order above.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from torch import nn

CONV = {2: nn.Conv2d, 3: nn.Conv3d}
NORM = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; a 1x1 projection where the shape changes.
    `dims` 2 for images, 3 for video (3x3x3 convolutions, the stride in all three)."""

    expansion = 1

    def __init__(self, channels_in: int, channels: int, stride: int, dims: int = 2):
        super().__init__()
        conv, norm = CONV[dims], NORM[dims]
        self.conv1 = conv(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = conv(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = norm(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(conv(channels_in, channels, 1, stride, bias=False),
                                            norm(channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduction, 3x3 (grouped for ResNeXt, carrying the stride: v1.5), 1x1 expansion
    to 4 * `channels`; a 1x1 projection where the shape changes."""

    expansion = 4

    def __init__(self, channels_in: int, channels: int, stride: int, groups: int = 1,
                 width_per_group: int = 64):
        super().__init__()
        inner = channels * width_per_group // 64 * groups
        out = channels * self.expansion
        self.conv1 = nn.Conv2d(channels_in, inner, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, inner, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = nn.Conv2d(inner, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != out:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet for images: `blocks` per stage, stage base widths width * (1, 2, 4, 8);
    `block` "basic" (ResNet-18/34) or "bottleneck" (ResNet-50, ResNeXt with `groups`
    and `width_per_group`)."""

    def __init__(self, width: int = 64, blocks: Sequence[int] = (2, 2, 2, 2),
                 classes: int = 1000, block: str = "basic", groups: int = 1,
                 width_per_group: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        stages, channels = [], width
        for index, count in enumerate(blocks):
            base = width * 2**index
            for number in range(count):
                stride = 2 if index > 0 and number == 0 else 1
                if block == "basic":
                    stages.append(BasicBlock(channels, base, stride))
                else:
                    stages.append(Bottleneck(channels, base, stride, groups, width_per_group))
                channels = base * stages[-1].expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(channels, classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


class VideoResNet(nn.Module):
    """R3D: a Conv3d stem (kernel (3, 7, 7), stride (1, 2, 2), no pooling), stages of 3-D
    basic blocks with widths 64, 128, 256, 512 (the stride 2 in time and space)."""

    def __init__(self, blocks: Sequence[int] = (2, 2, 2, 2), classes: int = 400):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 64, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                                  nn.BatchNorm3d(64), nn.ReLU(inplace=True))
        stages, channels = [], 64
        for index, count in enumerate(blocks):
            for number in range(count):
                stride = 2 if index > 0 and number == 0 else 1
                stages.append(BasicBlock(channels, 64 * 2**index, stride, dims=3))
                channels = 64 * 2**index
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                  nn.Linear(channels, classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


def _conv_bn(channels_in: int, channels: int, kernel: int, stride: int = 1, groups: int = 1,
             activation: type[nn.Module] | None = None, eps: float = 1e-5) -> nn.Sequential:
    """Convolution ("same" padding, no bias), BatchNorm, then `activation` if any."""
    layers = [nn.Conv2d(channels_in, channels, kernel, stride, (kernel - 1) // 2,
                        groups=groups, bias=False), nn.BatchNorm2d(channels, eps=eps)]
    if activation is not None:
        layers.append(activation(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion (unless `expand` is 1), depthwise 3x3 carrying
    the stride, 1x1 linear projection; a residual where the shape stays."""

    def __init__(self, channels_in: int, channels: int, stride: int, expand: int):
        super().__init__()
        hidden = channels_in * expand
        layers = [] if expand == 1 else [_conv_bn(channels_in, hidden, 1, activation=nn.ReLU6)]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden, activation=nn.ReLU6),
                   _conv_bn(hidden, channels, 1)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and channels_in == channels

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(nn.Module):
    """MobileNetV2, width multiplier 1.0 (all channel counts already multiples of 8)."""

    # (expansion, channels, blocks, stride of the first block)
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, classes: int = 1000):
        super().__init__()
        layers, channels = [_conv_bn(3, 32, 3, 2, activation=nn.ReLU6)], 32
        for expand, out, count, stride in self.SETTINGS:
            for number in range(count):
                layers.append(InvertedResidual(channels, out, stride if number == 0 else 1,
                                               expand))
                channels = out
        layers.append(_conv_bn(channels, 1280, 1, activation=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes))

    def forward(self, x):
        return self.head(self.features(x))


class SqueezeExcitation(nn.Module):
    """Global average pooling, 1x1 Conv2d down to `squeeze` channels, SiLU, 1x1 Conv2d
    back, sigmoid: the scale of each channel of the input (both convolutions with bias)."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, squeeze, 1)
        self.expand = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU(inplace=True)

    def forward(self, x):
        scale = self.expand(self.activation(self.reduce(self.pool(x))))
        return x * scale.sigmoid()


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expansion (unless `expand` is 1), depthwise `kernel` x
    `kernel` carrying the stride, squeeze-excitation to a quarter of the block's input
    channels, 1x1 linear projection; a residual where the shape stays (without
    torchvision's stochastic depth)."""

    def __init__(self, channels_in: int, channels: int, kernel: int, stride: int, expand: int):
        super().__init__()
        hidden = channels_in * expand
        layers = [] if expand == 1 else [
            _conv_bn(channels_in, hidden, 1, activation=nn.SiLU, eps=1e-3)]
        layers += [_conv_bn(hidden, hidden, kernel, stride, groups=hidden, activation=nn.SiLU,
                            eps=1e-3),
                   SqueezeExcitation(hidden, max(1, channels_in // 4)),
                   _conv_bn(hidden, channels, 1, eps=1e-3)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and channels_in == channels

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class EfficientNetB0(nn.Module):
    """EfficientNet-B0's layout (width and depth 1.0) without stochastic depth and
    without the classifier's dropout."""

    # (expansion, kernel, stride of the first block, channels, blocks)
    SETTINGS = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))

    def __init__(self, classes: int = 1000):
        super().__init__()
        layers, channels = [_conv_bn(3, 32, 3, 2, activation=nn.SiLU, eps=1e-3)], 32
        for expand, kernel, stride, out, count in self.SETTINGS:
            for number in range(count):
                layers.append(MBConv(channels, out, kernel, stride if number == 0 else 1, expand))
                channels = out
        layers.append(_conv_bn(channels, 1280, 1, activation=nn.SiLU, eps=1e-3))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes))

    def forward(self, x):
        return self.head(self.features(x))


def resnet18(width: int = 64, blocks: Sequence[int] = (2, 2, 2, 2),
             classes: int = 1000) -> nn.Module:
    return ResNet(width, blocks, classes)


def resnet50(classes: int = 1000) -> nn.Module:
    return ResNet(64, (3, 4, 6, 3), classes, block="bottleneck")


def resnext50(classes: int = 1000) -> nn.Module:
    return ResNet(64, (3, 4, 6, 3), classes, block="bottleneck", groups=32, width_per_group=4)


def mobilenet_v2(classes: int = 1000) -> nn.Module:
    return MobileNetV2(classes)


def efficientnet_b0(classes: int = 1000) -> nn.Module:
    return EfficientNetB0(classes)


def r3d_18(classes: int = 400) -> nn.Module:
    return VideoResNet((2, 2, 2, 2), classes)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18, "resnet50": resnet50, "resnext50": resnext50,
    "mobilenet_v2": mobilenet_v2, "efficientnet_b0": efficientnet_b0, "r3d_18": r3d_18}
VIDEO = {"r3d_18"}  # input (batch, 3, frames, size, size)

# defaults: (batch, size) of images and videos; frames of videos
IMAGE_DEFAULTS, VIDEO_DEFAULTS, FRAMES = (8, 112), (2, 56), 8


def input_shape(name: str, batch: int | None = None, size: int | None = None,
                frames: int | None = None) -> tuple[int, ...]:
    """The input's shape for model `name`: (batch, 3, size, size) for images, by default
    8 x 3 x 112 x 112; (batch, 3, frames, size, size) for r3d_18, by default
    2 x 3 x 8 x 56 x 56: its forward pass there is 21 GFLOP, 2.7 times resnet18's at the
    images' defaults, where at batch 8 and 112 x 112 it would be 326 GFLOP, 42 times. A
    `batch` or `size` given applies to every model alike; `frames` only to videos."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name in VIDEO:
        batch_, size_ = VIDEO_DEFAULTS
        return (batch or batch_, 3, frames or FRAMES, size or size_, size or size_)
    batch_, size_ = IMAGE_DEFAULTS
    return (batch or batch_, 3, size or size_, size or size_)


def classes(name: str) -> int:
    """The model's number of output classes: torchvision's (ImageNet 1000, Kinetics 400)."""
    return 400 if name in VIDEO else 1000


def add_size_options(parser: argparse.ArgumentParser) -> None:
    """--batch and --size (input_shape's), --width and --blocks (resnet18's), as the
    one-model tools (first_steps, in_model) take them."""
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--width", type=int, default=None, help="resnet18 only")
    parser.add_argument("--blocks", default=None, help="resnet18 only, e.g. 1,1,1,1")


def check_size_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--blocks as a list; --width and --blocks only with args.model resnet18."""
    args.blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else None
    if (args.width or args.blocks) and args.model != "resnet18":
        parser.error("--width and --blocks shape resnet18 only")
