"""Layer lists for ahead-of-time generation: JSON files and benchdnn descriptor files.

A layer is one op call described by shapes: ``{"op": kind, "inputs": [shape, shape
(, shape input value)], "attrs": {...}, "dtype": "f32", "name": "..."}``, the same
arguments as ``convgrad.infer_shape`` plus the dtype. benchdnn descriptors (format:
``../shared/benchdnn_conv_shapes/SOURCE.md``) describe forward convolutions; each
becomes one layer per requested gradient op.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from convgrad.codegen.ops import OPS, TRANSPOSE_WEIGHTS_FORMAT, Problem, resolve

DEFAULT_OPS = ("ConvolutionBackwardData", "ConvolutionBackwardWeights")
# Short names of the op kinds a layer list generates (the benchmark's and the CLI's --ops)
OP_ALIASES = {"data": "ConvolutionBackwardData", "weights": "ConvolutionBackwardWeights",
              "fwd": "ConvTransposeBackwardData", "tweights": "ConvTransposeBackwardWeights"}
_AXES = "dhw"


@dataclass(frozen=True)
class Layer:
    op: str
    inputs: tuple
    attrs: dict = field(hash=False)
    dtype: str = "f32"
    name: str = ""
    batch: int = 1  # the batch of the layer's shapes, for reports

    def resolve(self) -> Problem:
        shape_input = self.inputs[2] if len(self.inputs) > 2 else None
        return resolve(self.op, self.inputs[:2], self.attrs, shape_input, self.dtype)


def load_json(path: Path) -> list[Layer]:
    """Layers from a JSON list of {"op", "inputs", "attrs", "dtype", "name"} objects."""
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of layer objects")
    layers = []
    for index, entry in enumerate(entries):
        unknown = set(entry) - {"op", "inputs", "attrs", "dtype", "name"}
        if unknown or "op" not in entry or "inputs" not in entry:
            raise ValueError(f"{path}[{index}]: expected keys op, inputs and optionally "
                             f"attrs, dtype, name; got {sorted(entry)}")
        inputs = tuple(tuple(shape) for shape in entry["inputs"])
        layers.append(Layer(entry["op"], inputs, dict(entry.get("attrs", {})),
                            entry.get("dtype", "f32"), entry.get("name", f"{path}[{index}]"),
                            batch=inputs[0][0] if inputs and inputs[0] else 1))
    return layers


@dataclass(frozen=True)
class ConvShape:
    """One benchdnn forward convolution, with the pads and sizes it implies."""

    name: str
    groups: int
    batch: int
    in_channels: int
    out_channels: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    dilations: tuple[int, ...]  # 1-based, as the ops take them

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the forward convolution (each gradient costs the same)."""
        count = 2 * self.batch * self.out_channels * (self.in_channels // self.groups)
        for x, k in zip(self.dst, self.kernel, strict=True):
            count *= x * k
        return count


def _tokens(text: str) -> list[str]:
    """Whitespace-separated descriptors; `#` starts a comment, a trailing `\\`
    continues the token on the next line."""
    tokens = []
    for line in text.replace("\\\n", "").splitlines():
        for token in line.split():
            if token.startswith("#"):
                break
            tokens.append(token)
    return tokens


_FIELD = re.compile(r"(mb|g|ic|oc|[iokspd][dhw]|d[dhw])(\d+)")


def parse_descriptor(token: str) -> ConvShape:
    """One benchdnn convolution descriptor, following str2desc/sanitize_desc."""
    body, _, name = token.partition("n")
    values: dict[str, int] = {}
    position = 0
    body = body.replace("_", "")
    while position < len(body):
        match = _FIELD.match(body, position)
        if not match:
            raise ValueError(f"benchdnn descriptor {token!r}: cannot read {body[position:]!r}")
        values[match.group(1)] = int(match.group(2))
        position = match.end()
    name = name.strip('"')
    present = [a for a in _AXES if any(f"{p}{a}" in values for p in "ioksdp")]
    if not present:
        raise ValueError(f"benchdnn descriptor {token!r}: no spatial sizes")
    if "d" in present and "h" not in present and "w" not in present:
        present = list(_AXES)
        _copy_axis(values, "d", "hw")
    elif "d" in present and "w" not in present:
        raise ValueError(f"benchdnn descriptor {token!r}: depth and height without width")
    elif "h" in present and "w" not in present:
        present = ["h", "w"]
        _copy_axis(values, "h", "w")
    axes = [a for a in _AXES if a in present]
    src, dst, kernel, strides, pb, pe, dil = [], [], [], [], [], [], []
    for a in axes:
        if f"i{a}" not in values or f"k{a}" not in values:
            raise ValueError(f"benchdnn descriptor {token!r}: i{a} and k{a} are required")
        i, k = values[f"i{a}"], values[f"k{a}"]
        s, d = values.get(f"s{a}", 1), values.get(f"d{a}", 0)
        extent = (k - 1) * (d + 1) + 1
        if f"o{a}" in values:
            o = values[f"o{a}"]
            p = values.get(f"p{a}", ((o - 1) * s - i + extent) // 2)
        else:
            p = values.get(f"p{a}", 0)
            o = (i - extent + 2 * p) // s + 1
        p_end = (o - 1) * s - i + extent - p
        # A negative end pad above -s is the same problem with end pad 0 (SOURCE.md).
        if p_end < 0 and p_end > -s:
            p_end = 0
        if p_end < 0 or o < 1 or (i - extent + p + p_end) // s + 1 != o:
            raise ValueError(f"benchdnn descriptor {token!r}: inconsistent sizes on axis {a}")
        src.append(i)
        dst.append(o)
        kernel.append(k)
        strides.append(s)
        pb.append(p)
        pe.append(p_end)
        dil.append(d + 1)
    return ConvShape(name=name or token, groups=values.get("g", 1), batch=values.get("mb", 2),
                     in_channels=values["ic"], out_channels=values["oc"], src=tuple(src),
                     dst=tuple(dst), kernel=tuple(kernel), strides=tuple(strides),
                     pads_begin=tuple(pb), pads_end=tuple(pe), dilations=tuple(dil))


def _copy_axis(values: dict[str, int], source: str, targets: str) -> None:
    for prefix in "ioksdp":
        if f"{prefix}{source}" in values:
            for t in targets:
                values.setdefault(f"{prefix}{t}", values[f"{prefix}{source}"])


def parse_benchdnn(text: str) -> list[ConvShape]:
    """Every descriptor of a benchdnn shape file."""
    return [parse_descriptor(token) for token in _tokens(text)]


def conv_layers(conv: ConvShape, ops=DEFAULT_OPS, *, batch: int | None = None,
                dtype: str = "f32", data_format: str = "NXC",
                weights_format: str | None = None) -> list[Layer]:
    """The gradient-op layers of one forward convolution."""
    n = conv.batch if batch is None else batch
    g, ic, oc = conv.groups, conv.in_channels, conv.out_channels

    def data(c, spatial):
        return (n, *spatial, c) if data_format == "NXC" else (n, c, *spatial)

    layers = []
    for kind in ops:
        spec = OPS[kind]
        fmt = weights_format or spec.weights_formats[1]
        if spec.transpose:  # ConvTranspose ops: the forward conv's dst is their src
            fmt = TRANSPOSE_WEIGHTS_FORMAT.get(fmt, fmt)
        attrs = {"strides": list(conv.strides), "pads_begin": list(conv.pads_begin),
                 "pads_end": list(conv.pads_end), "dilations": list(conv.dilations),
                 "groups": g, "data_format": data_format, spec.weights_attr: fmt}

        def weights(o, i_g, fmt=fmt):
            if fmt in ("XIO", "XOI"):
                return (*conv.kernel, i_g, o)
            if fmt in ("OXI", "IXO"):
                return (o, *conv.kernel, i_g)
            return (o, i_g, *conv.kernel)

        if spec.family == "bwd_data":
            inputs = (data(oc, conv.dst), weights(oc, ic // g), tuple(conv.src))
        elif kind == "ConvTransposeBackwardData":  # diff_dst is the large tensor
            inputs = (data(ic, conv.src), weights(oc, ic // g))
        elif spec.transpose:  # ConvTransposeBackwardWeights(src small, diff_dst large)
            inputs = (data(oc, conv.dst), data(ic, conv.src), tuple(conv.kernel))
        else:
            inputs = (data(ic, conv.src), data(oc, conv.dst), tuple(conv.kernel))
        layers.append(Layer(kind, inputs, attrs, dtype, conv.name, batch=n))
    return layers
