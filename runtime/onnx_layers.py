"""Layers from an ONNX model: the gradient ops that training its convolutions needs.

``load_onnx(path)`` reads the model (shapes only: external weight data is not
loaded), runs ONNX shape inference and turns every ``Conv`` node into a
ConvolutionBackwardData and a ConvolutionBackwardWeights layer, and every
``ConvTranspose`` node into a ConvTransposeBackwardData and a
ConvTransposeBackwardWeights layer, with the node's strides, dilations, groups and
pads (ONNX's ``auto_pad`` and ``output_shape`` rules worked out first, so each layer
computes what the node's gradient is). Every layer is resolved before it is returned.

The ``onnx`` package is optional (``pip install onnx`` or the ``onnx`` extra); it
is imported on the first call.
"""

from __future__ import annotations

from pathlib import Path

from convgrad.codegen.layers import Layer
from convgrad.codegen.ops import OPS

CONV_OPS = ("ConvolutionBackwardData", "ConvolutionBackwardWeights")
TRANSPOSE_OPS = ("ConvTransposeBackwardData", "ConvTransposeBackwardWeights")
_AUTO_PAD = {"NOTSET": "none", "": "none", "SAME_UPPER": "same_upper",
             "SAME_LOWER": "same_lower", "VALID": "valid"}
_DOMAINS = ("", "ai.onnx")


def load_onnx(path: Path, *, dtype: str = "f32", batch: int | None = None,
              data_format: str = "NCX") -> list[Layer]:
    """The gradient-op layers of every Conv and ConvTranspose node of an ONNX model.

    `batch` replaces the batch dimension of every node (it is required when the
    model's batch is symbolic); `data_format` is the layout of the layers' data
    shapes (ONNX's own is NCX; NXC permutes them). Weights are OIX (Conv) and IOX
    (ConvTranspose), as ONNX stores them. Layers are in node order, two per node,
    named after the node; nothing is deduplicated.
    """
    try:
        import onnx
    except ImportError as error:
        raise RuntimeError("reading ONNX models needs the onnx package: pip install onnx "
                           "(or pip install 'convgrad[onnx]')") from error
    if data_format not in ("NCX", "NXC"):
        raise ValueError(f"load_onnx: data_format = {data_format!r} is invalid; "
                         f"expected 'NCX' or 'NXC'")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise ValueError(f"load_onnx: batch = {batch!r} is invalid; expected a positive "
                         f"integer or None")
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    if model.functions:  # Conv nodes inside model-local functions become visible
        try:
            from onnx import inliner
        except ImportError:
            inliner = None
        if inliner is not None:
            model = inliner.inline_local_functions(model)
        elif any(n.op_type in ("Conv", "ConvTranspose") for f in model.functions
                 for n in f.node):
            raise ValueError(f"{path}: Conv nodes inside model-local functions need "
                             f"onnx>=1.16 (onnx.inliner) to be read")
    model = onnx.shape_inference.infer_shapes(model)
    shapes: dict[str, tuple | None] = {}
    _collect_shapes(model.graph, shapes)
    layers: list[Layer] = []
    for node, default_name in _conv_nodes(model.graph, ""):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        layers += _node_layers(node, node.name or default_name, attrs, shapes, dtype=dtype,
                               batch=batch, data_format=data_format)
    return layers


def _dims(type_proto) -> tuple | None:
    """A tensor type's shape: ints, with a str (dim_param) or None for unknown sizes."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in type_proto.tensor_type.shape.dim)


def _collect_shapes(graph, shapes: dict) -> None:
    for value in (*graph.input, *graph.value_info, *graph.output):
        dims = _dims(value.type)
        if dims is not None or value.name not in shapes:
            shapes[value.name] = dims
    for tensor in graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
    for sparse in graph.sparse_initializer:
        shapes[sparse.values.name] = tuple(sparse.dims)
    for node in graph.node:
        for attribute in node.attribute:
            for sub in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                _collect_shapes(sub, shapes)


def _conv_nodes(graph, prefix: str):
    """(node, default name) of every Conv/ConvTranspose, subgraphs included, in order."""
    for index, node in enumerate(graph.node):
        default = f"{prefix}{node.op_type}_{index}"
        if node.op_type in ("Conv", "ConvTranspose") and node.domain in _DOMAINS:
            yield node, default
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.HasField("g") else []
            for sub in (*subgraphs, *attribute.graphs):
                yield from _conv_nodes(sub, f"{node.name or default}/{sub.name or 'body'}/")


def _node_layers(node, name: str, attrs: dict, shapes: dict, *, dtype: str,
                 batch: int | None, data_format: str) -> list[Layer]:
    transpose = node.op_type == "ConvTranspose"

    def fail(message: str):
        raise ValueError(f"ONNX node {name!r} ({node.op_type}): {message}")

    if len(node.input) < 2 or not node.input[0] or not node.input[1]:
        fail("expected inputs X and W")
    x, w = node.input[0], node.input[1]
    x_shape, w_shape = shapes.get(x), shapes.get(w)
    for label, tensor, shape in (("X", x, x_shape), ("W", w, w_shape)):
        if shape is None:
            fail(f"the shape of input {label} ({tensor!r}) is unknown (ONNX shape "
                 f"inference could not infer it); give the model static shapes")
    if not 3 <= len(x_shape) <= 5:
        fail(f"input X ({x!r}) has rank {len(x_shape)}; only 1, 2 or 3 spatial axes "
             f"(rank 3 to 5) are supported")
    if len(w_shape) != len(x_shape):
        fail(f"input W ({w!r}) has rank {len(w_shape)}, expected {len(x_shape)} like X")
    if batch is None and not isinstance(x_shape[0], int):
        fail(f"the batch dimension of input X ({x!r}) is symbolic ({x_shape[0]!r}); "
             f"pass batch=N (--batch N)")
    for label, tensor, shape, first in (("X", x, x_shape, 1), ("W", w, w_shape, 0)):
        for axis in range(first, len(shape)):
            if not isinstance(shape[axis], int) or shape[axis] < 1:
                fail(f"dimension {axis} of input {label} ({tensor!r}) is "
                     f"{shape[axis]!r}; only static, positive sizes are supported")
    n = x_shape[0] if batch is None else batch
    rank = len(x_shape) - 2
    channels, size = x_shape[1], tuple(x_shape[2:])

    def per_axis(key: str, default: int, count: int = rank) -> tuple[int, ...]:
        values = tuple(int(v) for v in attrs.get(key, [default] * count))
        if len(values) != count:
            fail(f"attribute {key} = {list(values)} has {len(values)} values; "
                 f"expected {count}")
        return values

    kernel = tuple(w_shape[2:])
    if "kernel_shape" in attrs and per_axis("kernel_shape", 1) != kernel:
        fail(f"kernel_shape = {list(attrs['kernel_shape'])} disagrees with the shape "
             f"{list(w_shape)} of W ({w!r})")
    strides, dilations = per_axis("strides", 1), per_axis("dilations", 1)
    pads = per_axis("pads", 0, 2 * rank)
    groups = int(attrs.get("group", 1))
    if min((*strides, *dilations, groups)) < 1:
        fail(f"strides {list(strides)}, dilations {list(dilations)} and group {groups} "
             f"must be positive")
    if min(pads) < 0:
        fail(f"pads = {list(pads)}: negative pads are not supported")
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad.upper() not in _AUTO_PAD:
        fail(f"auto_pad = {auto_pad!r} is unknown; expected NOTSET, SAME_UPPER, SAME_LOWER "
             f"or VALID")
    auto_pad = auto_pad.upper() or "NOTSET"
    extents = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilations, strict=True))
    upper = auto_pad == "SAME_UPPER"

    def split(total: int) -> tuple[int, int]:  # ONNX: the odd pad at the end for SAME_UPPER
        return (total // 2, total - total // 2) if upper else (total - total // 2, total // 2)

    output_padding = (0,) * rank
    output_shape_attr = None
    if not transpose:
        out_channels = w_shape[0]
        if w_shape[1] * groups != channels or out_channels % groups:
            fail(f"W ({w!r}) of shape {list(w_shape)} does not fit {channels} input "
                 f"channels in {groups} groups")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            begin_end = [split(max((-(-y // s) - 1) * s + e - y, 0))
                         for y, s, e in zip(size, strides, extents, strict=True)]
        elif auto_pad == "VALID":
            begin_end = [(0, 0)] * rank
        else:
            begin_end = list(zip(pads[:rank], pads[rank:], strict=True))
        pb, pe = (tuple(p[i] for p in begin_end) for i in (0, 1))
        result = tuple((y + b + e - k) // s + 1 for y, b, e, k, s in
                       zip(size, pb, pe, extents, strides, strict=True))
    else:
        if w_shape[0] != channels or channels % groups:
            fail(f"W ({w!r}) of shape {list(w_shape)} does not fit {channels} input "
                 f"channels in {groups} groups")
        out_channels = w_shape[1] * groups
        output_padding = per_axis("output_padding", 0)
        if min(output_padding) < 0:
            fail(f"output_padding = {list(output_padding)} must not be negative")
        full = tuple(s * (x - 1) + p + e for x, s, p, e in
                     zip(size, strides, output_padding, extents, strict=True))
        same = auto_pad in ("SAME_UPPER", "SAME_LOWER")
        if "output_shape" in attrs:
            output_shape_attr = tuple(int(v) for v in attrs["output_shape"])
            if len(output_shape_attr) not in (rank, rank + 2):
                fail(f"output_shape = {list(output_shape_attr)}: expected {rank} sizes")
            result = output_shape_attr[-rank:]
            if not same and result != full:
                # The spec splits the pads (the odd one first); onnx's reference
                # evaluator pads nothing and crops the end. Only SAME_* is unambiguous.
                fail(f"output_shape {list(result)} with auto_pad {auto_pad} is ambiguous "
                     f"in ONNX (the spec and onnx's reference place the pads differently); "
                     f"use explicit pads or auto_pad SAME_UPPER/SAME_LOWER")
        elif same and any(output_padding):
            # The spec's output size is X*s; ONNX shape inference says X*s + output_padding.
            fail(f"auto_pad {auto_pad} with output_padding {list(output_padding)} is "
                 f"ambiguous in ONNX (its spec and its shape inference give different "
                 f"output sizes); use explicit pads or output_shape")
        elif same:
            result = tuple(x * s for x, s in zip(size, strides, strict=True))
        if output_shape_attr is not None or same:
            begin_end = [split(f - r) for f, r in zip(full, result, strict=True)]
        elif auto_pad == "VALID":
            begin_end = [(0, 0)] * rank
        else:
            begin_end = list(zip(pads[:rank], pads[rank:], strict=True))
        pb, pe = (tuple(p[i] for p in begin_end) for i in (0, 1))
        if min((*pb, *pe)) < 0:
            fail(f"the output size {list(result)} needs negative pads {list(pb)}/{list(pe)}; "
                 f"not supported")
        result = tuple(f - b - e for f, b, e in zip(full, pb, pe, strict=True))
    if min(result) < 1:
        fail(f"the output spatial size {list(result)} is empty")
    inferred = shapes.get(node.output[0]) if node.output else None
    expected_y = (n, out_channels, *result)
    if inferred is not None and (len(inferred) != len(expected_y) or any(
            isinstance(v, int) and v != e for v, e in zip(inferred[1:], expected_y[1:],
                                                           strict=False))):
        fail(f"ONNX shape inference gives output {list(inferred)}, these rules give "
             f"{list(expected_y)}")

    def data(c: int, spatial) -> tuple[int, ...]:
        return (n, *spatial, c) if data_format == "NXC" else (n, c, *spatial)

    base = {"strides": list(strides), "dilations": list(dilations), "groups": groups,
            "data_format": data_format}
    if transpose:
        # The backward ops read diff_dst (size `result`) with a forward convolution whose
        # result is X: an output padding of a stride or more shortens the end pad.
        pe_backward = tuple(e - s * (p // s) for e, s, p in
                            zip(pe, strides, output_padding, strict=True))
        if min(pe_backward) < 0:
            fail(f"output_padding {list(output_padding)} of a stride or more with end pads "
                 f"{list(pe)} is not supported")
        pe = pe_backward
        kinds = TRANSPOSE_OPS
        specs = {
            "ConvTransposeBackwardData": ((data(out_channels, result), tuple(w_shape)),
                                          data(channels, size)),
            "ConvTransposeBackwardWeights": ((data(channels, size), data(out_channels, result),
                                              kernel), tuple(w_shape)),
        }
    else:
        kinds = CONV_OPS
        specs = {
            "ConvolutionBackwardData": ((data(out_channels, result), tuple(w_shape), size),
                                        data(channels, size)),
            "ConvolutionBackwardWeights": ((data(channels, size), data(out_channels, result),
                                            kernel), tuple(w_shape)),
        }
    explicit = {"pads_begin": list(pb), "pads_end": list(pe), "auto_pad": "none"}
    candidates = [explicit]
    if auto_pad != "NOTSET" and output_shape_attr is None:
        # The op's own auto_pad rule when it gives the node's pads (always for Conv;
        # for ConvTranspose the ops' TF-style rule can differ, then pads are explicit).
        candidates.insert(0, {"auto_pad": _AUTO_PAD[auto_pad]})
    layers = []
    for kind in kinds:
        spec = OPS[kind]
        inputs, expected = specs[kind]
        attrs_of_kind = {**base, spec.weights_attr: "IOX" if spec.transpose else "OIX"}
        if spec.has_output_padding and any(output_padding):
            attrs_of_kind["output_padding"] = list(output_padding)
        problem = error = None
        for padding in candidates:
            layer = Layer(kind, inputs, {**attrs_of_kind, **padding}, dtype, name, batch=n)
            try:
                problem = layer.resolve()
            except (ValueError, TypeError) as caught:
                error = caught
                continue
            if problem.pads_begin == pb and problem.output_shape == expected:
                break
            error = ValueError(f"{kind} gives pads_begin {list(problem.pads_begin)} and "
                               f"output {list(problem.output_shape)}; expected {list(pb)} "
                               f"and {list(expected)}")
            problem = None
        if problem is None:
            fail(f"cannot express its {kind} layer: {error}")
        layers.append(layer)
    return layers
