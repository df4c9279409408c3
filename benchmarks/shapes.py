"""The benchmarks' shape sets: benchdnn's forward convolutions, chosen per set.

Every forward convolution of a set becomes the layers of the ops the benchmarks time
(`OPS`: data, weights, fwd, tweights; convgrad.codegen.layers.conv_layers builds them).
The ResNet-50 list is the package's bundled copy, three sets are written here in
benchdnn's syntax (`INLINE`; ResNeXt-50's is one of JAX_SETS only, the JAX benchmarks'),
the others are a handful of representative descriptors of oneDNN benchdnn's files in
DEFAULT_SHAPES_DIR (a set whose file is missing is skipped).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from convgrad.codegen.layers import OP_ALIASES, ConvShape, parse_benchdnn

ROOT = Path(__file__).resolve().parent.parent

OPS = OP_ALIASES
DTYPES = ("f32", "bf16", "f16")
DEFAULT_SHAPES_DIR = ROOT.parent / "shared" / "benchdnn_conv_shapes"

# Shape sets: (file, selected descriptor names or None for every descriptor).
# The ResNet-50 list is the package's bundled copy; the others are a handful of
# representative descriptors of oneDNN benchdnn's files in DEFAULT_SHAPES_DIR.
SETS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "resnet50": ("shapes_resnet_50", None),
    "mobilenet_v2": ("(inline)", None),
    "resnet18_112": ("(inline)", None),
    "mobilenet_dw": ("shapes_mobilenet_dw", (
        "mobilenet:conv2_1/dw", "mobilenet:conv2_2/dw", "mobilenet:conv3_1/dw",
        "mobilenet:conv4_2/dw", "mobilenet:conv5_1/dw", "mobilenet:conv6/dw")),
    "dilated": ("shapes_dilated", (
        "dilated_conv:18", "dilated_conv:19", "dilated_conv:20", "dilated_conv:21",
        "dilated_conv:24", "dilated_conv:25", "dilated_conv:42/dw")),
    "1d": ("shapes_1d", (
        "conv_dw", "1d_gconv_channel-block-16", "conv1d:2", "conv1d:3", "conv1d:6",
        "conv1d:19", "conv1d_gemm:3")),
    "3d": ("shapes_3d", (
        "3d_conv_pad:1", "3d_conv_pad:4", "3d_conv:2", "vnet:conv3",
        "3d_gconv_channel-block-8", "3d_gconv_non-block_s2")),
    # grouped layers: 2-128 channels per group
    "resnext101": ("shapes_3d_resnext101", (
        "Resnext:conv_3d:1", "Resnext:conv_3d:4", "Resnext:conv_3d:6", "Resnext:conv_3d:8",
        "Resnext:conv_3d:11", "Resnext:conv_3d:15*2", "Resnext:conv_3d:19",
        "Resnext:conv_3d:22", "Resnext:conv_3d:25")),
    "gconv": ("shapes_3d", (
        "3d_gconv_channel-block-16", "3d_gconv_channel-block-8", "3d_gconv_channel-block-4",
        "3d_gconv_non-block", "3d_gconv_non-block_1x1", "3d_gconv_non-block_s2")),
}
BUNDLED = {"resnet50"}


def _descriptors(model: str, layers: Sequence[tuple[str, int, int, int, int, int, int, int]]
                 ) -> str:
    """benchdnn descriptors (batch 8, square, pads k // 2, no dilation) of (name, groups,
    in channels, out channels, input side, output side, kernel side, stride) rows."""
    return " ".join(
        f'mb8_g{g}ic{ic}oc{oc}_ih{i}oh{o}kh{k}sh{s}dh0ph{k // 2}_iw{i}ow{o}kw{k}sw{s}dw0pw{k // 2}'
        f'_n"{model}:{name}"' for name, g, ic, oc, i, o, k, s in layers)


# Sets written here in benchdnn's syntax.
INLINE = {
    # MobileNetV2's distinct layers at a 112x112 input (as benchmarks/models.py builds
    # it): the 1x1 expand and project layers (16-320 channels on 56x56 to 4x4) and the
    # 3x3 depthwise layers (the stem and the last 1x1 too).
    "mobilenet_v2": _descriptors("mobilenet_v2", (
        ("stem", 1, 3, 32, 112, 56, 3, 2), ("dw32", 32, 32, 32, 56, 56, 3, 1),
        ("pw32-16", 1, 32, 16, 56, 56, 1, 1), ("pw16-96", 1, 16, 96, 56, 56, 1, 1),
        ("dw96s2", 96, 96, 96, 56, 28, 3, 2), ("pw96-24", 1, 96, 24, 28, 28, 1, 1),
        ("pw24-144", 1, 24, 144, 28, 28, 1, 1), ("dw144", 144, 144, 144, 28, 28, 3, 1),
        ("pw144-24", 1, 144, 24, 28, 28, 1, 1), ("dw144s2", 144, 144, 144, 28, 14, 3, 2),
        ("pw144-32", 1, 144, 32, 14, 14, 1, 1), ("pw32-192", 1, 32, 192, 14, 14, 1, 1),
        ("dw192", 192, 192, 192, 14, 14, 3, 1), ("pw192-32", 1, 192, 32, 14, 14, 1, 1),
        ("pw64-384", 1, 64, 384, 7, 7, 1, 1), ("dw384", 384, 384, 384, 7, 7, 3, 1),
        ("pw384-96", 1, 384, 96, 7, 7, 1, 1), ("dw576s2", 576, 576, 576, 7, 4, 3, 2),
        ("pw160-960", 1, 160, 960, 4, 4, 1, 1), ("dw960", 960, 960, 960, 4, 4, 3, 1),
        ("pw960-320", 1, 960, 320, 4, 4, 1, 1), ("pw320-1280", 1, 320, 1280, 4, 4, 1, 1))),
    # ResNet-18's distinct layers at a 112x112 input: half ImageNet's sizes (56 to 4)
    "resnet18_112": _descriptors("resnet18_112", (
        ("conv1", 1, 3, 64, 112, 56, 7, 2), ("l1", 1, 64, 64, 28, 28, 3, 1),
        ("l2s2", 1, 64, 128, 28, 14, 3, 2), ("l2", 1, 128, 128, 14, 14, 3, 1),
        ("l2down", 1, 64, 128, 28, 14, 1, 2), ("l3s2", 1, 128, 256, 14, 7, 3, 2),
        ("l3", 1, 256, 256, 7, 7, 3, 1), ("l3down", 1, 128, 256, 14, 7, 1, 2),
        ("l4s2", 1, 256, 512, 7, 4, 3, 2), ("l4", 1, 512, 512, 4, 4, 3, 1),
        ("l4down", 1, 256, 512, 7, 4, 1, 2))),
    # ResNeXt-50 (32x4d, torchvision's: the stride on the grouped 3x3) at 224x224: its
    # distinct layers, the grouped 3x3 ones with 4-32 channels per group (JAX_SETS only).
    "resnext50": _descriptors("resnext50", (
        ("conv1", 1, 3, 64, 224, 112, 7, 2),
        ("l1.0.conv1", 1, 64, 128, 56, 56, 1, 1), ("l1.conv2", 32, 128, 128, 56, 56, 3, 1),
        ("l1.conv3", 1, 128, 256, 56, 56, 1, 1), ("l1.0.down", 1, 64, 256, 56, 56, 1, 1),
        ("l1.conv1", 1, 256, 128, 56, 56, 1, 1),
        ("l2.0.conv1", 1, 256, 256, 56, 56, 1, 1), ("l2.0.conv2", 32, 256, 256, 56, 28, 3, 2),
        ("l2.conv3", 1, 256, 512, 28, 28, 1, 1), ("l2.0.down", 1, 256, 512, 56, 28, 1, 2),
        ("l2.conv1", 1, 512, 256, 28, 28, 1, 1), ("l2.conv2", 32, 256, 256, 28, 28, 3, 1),
        ("l3.0.conv1", 1, 512, 512, 28, 28, 1, 1), ("l3.0.conv2", 32, 512, 512, 28, 14, 3, 2),
        ("l3.conv3", 1, 512, 1024, 14, 14, 1, 1), ("l3.0.down", 1, 512, 1024, 28, 14, 1, 2),
        ("l3.conv1", 1, 1024, 512, 14, 14, 1, 1), ("l3.conv2", 32, 512, 512, 14, 14, 3, 1),
        ("l4.0.conv1", 1, 1024, 1024, 14, 14, 1, 1),
        ("l4.0.conv2", 32, 1024, 1024, 14, 7, 3, 2),
        ("l4.conv3", 1, 1024, 2048, 7, 7, 1, 1), ("l4.0.down", 1, 1024, 2048, 14, 7, 1, 2),
        ("l4.conv1", 1, 2048, 1024, 7, 7, 1, 1), ("l4.conv2", 32, 1024, 1024, 7, 7, 3, 1))),
}
# The JAX benchmarks' sets: bench.py's and ResNeXt-50's (bench.py has the 3-D
# ResNeXt-101 only).
JAX_SETS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    **SETS, "resnext50": ("(inline)", None)}


# The tiny problem of the call-overhead measurement: 1x1, N=1, 4x4, 16 channels.
TINY = ConvShape(name="tiny", groups=1, batch=1, in_channels=16, out_channels=16,
                 src=(4, 4), dst=(4, 4), kernel=(1, 1), strides=(1, 1), pads_begin=(0, 0),
                 pads_end=(0, 0), dilations=(1, 1))


def load_set(name: str, shapes_dir: Path, limit: int | None,
             layers: Sequence[str] = ()) -> list[ConvShape] | None:
    """The forward convolutions of a shape set (one of JAX_SETS, which holds SETS; None
    when its file is missing), only those whose name contains one of `layers` when it
    is not empty."""
    file, selection = JAX_SETS[name]
    if name in INLINE:
        text = INLINE[name]
    elif name in BUNDLED:
        text = (resources.files("convgrad.codegen") / "data" / file).read_text()
    else:
        path = shapes_dir / file
        if not path.is_file():
            return None
        text = path.read_text()
    return _select(parse_benchdnn(text), selection, limit, layers)


def load_file(path: Path, limit: int | None, layers: Sequence[str] = ()) -> list[ConvShape]:
    """Every forward convolution of a benchdnn shape file of one's own (load_set's
    `limit` and `layers`)."""
    return _select(parse_benchdnn(Path(path).read_text()), None, limit, layers)


def _select(convs: list[ConvShape], selection: tuple[str, ...] | None, limit: int | None,
            layers: Sequence[str]) -> list[ConvShape]:
    if selection is not None:
        by_name: dict[str, ConvShape] = {}
        for conv in convs:
            by_name.setdefault(conv.name, conv)  # a repeated name: its first descriptor
        convs = [by_name[n] for n in selection if n in by_name]
    if layers:
        convs = [c for c in convs if any(part in c.name for part in layers)]
    return convs[:limit] if limit else convs


def load_sets(names: Sequence[str], shapes_dir: Path, limit: int | None,
              layers: Sequence[str] = ()) -> list[tuple[str, ConvShape]]:
    """(set, convolution) of every named set (load_set's arguments), saying on stderr
    which sets are skipped for a missing shape file."""
    shapes = []
    for name in names:
        convs = load_set(name, shapes_dir, limit, layers)
        if convs is None:
            print(f"skipping set {name}: {shapes_dir / JAX_SETS[name][0]} not found",
                  file=sys.stderr)
            continue
        shapes += [(name, conv) for conv in convs]
    return shapes


def torch_dst(conv: ConvShape) -> tuple[int, ...]:
    """The output size PyTorch computes with symmetric padding pads_begin."""
    return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1 for i, p, d, k, s in zip(
        conv.src, conv.pads_begin, conv.dilations, conv.kernel, conv.strides, strict=True))
