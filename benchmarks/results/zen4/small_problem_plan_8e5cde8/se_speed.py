"""EfficientNet-B0's squeeze-and-excitation convolutions (1x1 on one pixel, batch 8, NXC,
f32, 2 threads), forward and data gradient: the rules' kernel against one with tiles of
at most TILE_ROWS rows, in one process, alternating 9 x 0.05 s; exact on integer data.

    python se_speed.py [TILE_ROWS]     # default 2
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench  # noqa: E402

from convgrad import api, bound, kernels  # noqa: E402
from convgrad.codegen.layers import ConvShape, conv_layers  # noqa: E402

PAIRS = [(96, 4), (4, 96), (144, 6), (6, 144), (240, 10), (10, 240), (480, 20), (20, 480),
         (672, 28), (28, 672), (1152, 48), (48, 1152)]


def main() -> None:
    plan = {"tile_rows": int(sys.argv[1]) if len(sys.argv) > 1 else 2}
    rng = np.random.default_rng(0)
    ratios = []
    for cin, cout in PAIRS:
        conv = ConvShape(name="se", groups=1, batch=8, in_channels=cin, out_channels=cout,
                         src=(1, 1), dst=(1, 1), kernel=(1, 1), strides=(1, 1),
                         pads_begin=(0, 0), pads_end=(0, 0), dilations=(1, 1))
        for op in ("fwd", "data"):
            (layer,) = conv_layers(conv, (bench.OPS[op],), batch=8)
            arrays = [bench.aligned(rng.integers(-3, 4, shape).astype(np.float32))
                      for shape in layer.inputs[:2]]
            inputs = [*arrays, *([list(layer.inputs[2])] if len(layer.inputs) > 2 else [])]

            def run(layer=layer, inputs=inputs):
                return api.execute(layer.op, inputs, layer.attrs, num_threads=2)

            bound.reset()
            expected = run().copy()
            [call] = bound.bound_calls()
            rules = kernels.get_kernel(call.kernel.config, None)
            short = kernels.get_kernel(call.kernel.config, plan)
            call.kernel = short
            assert np.array_equal(run(), expected)
            times: dict[str, list[float]] = {"rules": [], "short": []}
            order = [("rules", rules), ("short", short)]
            for rep in range(9):
                for tag, kernel in order if rep % 2 else order[::-1]:
                    call.kernel = kernel
                    run()
                    begin, count = time.perf_counter(), 0
                    while time.perf_counter() - begin < 0.05:
                        run()
                        count += 1
                    times[tag].append((time.perf_counter() - begin) / count * 1e6)
            a, b = statistics.median(times["rules"]), statistics.median(times["short"])
            ratios.append(b / a)
            print(f"{op:4s} {cin:5d}->{cout:5d}  rules {a:7.1f} us  tiles of {plan['tile_rows']} "
                  f"{b:7.1f} us  time ratio {b / a:.3f}")
    print("geomean time ratio", round(statistics.geometric_mean(ratios), 3))


if __name__ == "__main__":
    main()
