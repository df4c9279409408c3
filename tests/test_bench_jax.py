"""The JAX benchmarks (benchmarks.jax_ops, benchmarks.jax_train_step) run end to
end on tiny settings, in their own processes per thread count, and write their outputs;
every convgrad row ran convgrad's kernels and agrees with lax."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from benchmarks import jax_cases, jax_models, jax_ops, jax_train_step

jax = pytest.importorskip("jax")

OPS_COLUMNS = {"shape_set", "layer", "op", "threads", "batch", "dtype", "layout", "flops",
               "lax_ms", "convgrad_ms", "ratio", "lax_calls", "convgrad_calls", "lax_capped",
               "max_rel_diff", "path", "convgrad_hlo", "lax_hlo", "note"}


@pytest.mark.parametrize("layer,layout,dtype,capped", [("pw96-24", "nhwc", "f32", False),
                                                       ("dw144s2", "nchw", "bf16", True)])
def test_ops_benchmark_writes_table_csv_and_json(tmp_path, capsys, layer, layout, dtype,
                                                 capped):
    """A 1x1 and a depthwise layer of MobileNetV2, each op: convgrad's path ran one
    kernel (checked in the HLO), agrees with lax, and both were timed; a lax call over
    --max-lax-seconds is timed once."""
    argv = ["--set", "mobilenet_v2", "--layers", layer, "--batch", "1",
            "--threads", "1", "--min-time", "0.01", "--layout", layout, "--dtype", dtype,
            "--keep-cache", "--out", str(tmp_path)]
    if capped:
        argv += ["--max-lax-seconds", "1e-9"]
    assert jax_ops.main(argv) == 0
    printed = capsys.readouterr().out
    assert "lax ms" in printed and "convgrad ms" in printed and "geometric mean" in printed
    assert "geometric mean" in (tmp_path / "table.txt").read_text()
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) >= OPS_COLUMNS
    assert [(r["layer"], r["op"]) for r in rows] == [
        (f"mobilenet_v2:{layer}", op) for op in ("fwd", "data", "weights")]
    data_format = {"nhwc": "NXC", "nchw": "NCX"}[layout]
    for row in rows:
        assert row["path"] == (f"convgrad {jax_cases.KERNELS[row['op']]} ({data_format}, "
                               f"{'XIO' if layout == 'nhwc' else 'OIX'} weights)")
        assert row["convgrad_hlo"] == "1 convgrad"
        assert float(row["max_rel_diff"]) < jax_cases.TOLERANCE[dtype]
        lax_ms, ours_ms = float(row["lax_ms"]), float(row["convgrad_ms"])
        assert lax_ms > 0 and ours_ms > 0
        assert float(row["ratio"]) == pytest.approx(lax_ms / ours_ms, rel=1e-3)
        assert int(row["convgrad_calls"]) >= 3
        assert (row["lax_capped"] == "True") == capped
        assert int(row["lax_calls"]) == 1 if capped else int(row["lax_calls"]) >= 3
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["cpu"] and results["machine"]["jax"] == jax.__version__
    assert results["threads"] == [{"threads": 1, "pjrt_nproc": "1", "convgrad_threads": 1,
                                   "cpus_allowed": len(os.sched_getaffinity(0))}]
    assert results["settings"]["dtype"] == dtype and results["settings"]["layout"] == layout
    assert [(m["op"], m["layers"]) for m in results["geomean"]] == [
        ("fwd", 1), ("data", 1), ("weights", 1)]


def test_resnext50_layers_are_torchvisions_distinct_layers():
    args = jax_ops.parse_args(["--set", "resnext50"])
    convs = jax_ops.load_shapes("resnext50", args)
    assert len(convs) == 24 and len({c.name for c in convs}) == 24
    grouped = [c for c in convs if c.groups > 1]
    assert len(grouped) == 7 and all(c.groups == 32 for c in grouped)
    assert {c.in_channels // c.groups for c in grouped} == {4, 8, 16, 32}
    assert all(c.dst == tuple((i - 1) // s + 1 for i, s in zip(c.src, c.strides, strict=True))
               for c in convs)


def test_a_worker_without_xlas_thread_count_refuses_to_run(tmp_path, monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    with pytest.raises(SystemExit, match="PJRT_NPROC"):
        jax_ops.main(["--limit", "1", "--threads", "2", "--worker", str(tmp_path / "w.json")])


def test_pjrt_nproc_sizes_xlas_cpu_thread_pool():
    """What the benchmarks rely on: PJRT_NPROC, read when jax creates its CPU client,
    sizes the pool of threads XLA's CPU convolutions run on."""
    code = textwrap.dedent("""
        import os, jax, jax.numpy as jnp
        x = jnp.ones((2, 16, 16, 32)); w = jnp.ones((3, 3, 32, 32))
        jax.jit(lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(x, w
        ).block_until_ready()
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        print(sum("XLAEigen" in name for name in names))
    """)
    counts = {}
    for threads in (1, 2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "PJRT_NPROC": str(threads)})
        counts[threads] = int(out.stdout.split()[-1])
    assert counts[2] == 2 and counts[1] < 2


def test_train_step_benchmark_writes_table_csv_and_json(tmp_path, capsys):
    """Tiny models (width x 1/8, one block, 32x32): every convolution of convgrad's step
    is a convgrad call, and its loss and gradient norm agree with lax's."""
    status = jax_train_step.main(["--model", "resnet18,mobilenet_v2", "--batch", "2",
                                  "--size", "32", "--width-mult", "0.125", "--blocks", "1",
                                  "--threads", "1", "--min-time", "0", "--keep-cache",
                                  "--out", str(tmp_path)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "lax ms" in printed and "convgrad ms" in printed
    assert "convgrad ms" in (tmp_path / "table.txt").read_text()
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["dtype"], r["threads"]) for r in rows] == [
        ("resnet18", "f32", "1"), ("mobilenet_v2", "f32", "1")]
    # resnet18: stem, one basic block; mobilenet_v2: stem, one inverted residual, last 1x1
    assert [int(r["convolutions"]) for r in rows] == [3, 4]
    for row in rows:
        convolutions = int(row["convolutions"])
        assert int(row["convgrad_hlo_convolutions"]) == 0
        # forward, data and weight gradients; the input's gradient is not taken
        assert int(row["convgrad_hlo_calls"]) == 3 * convolutions - 1
        assert int(row["lax_hlo_convolutions"]) > 0
        assert float(row["loss_rel_diff"]) < 1e-3 and float(row["grad_norm_rel_diff"]) < 1e-3
        assert float(row["conv_grad_max_rel_diff"]) < 1e-3
        assert float(row["lax_ms"]) > 0 and float(row["convgrad_ms"]) > 0
        assert int(row["lax_steps"]) >= 3 and int(row["convgrad_steps"]) >= 3
        assert float(row["lax_first_step_ms"]) > 0 and float(row["convgrad_first_step_ms"]) > 0
        assert 0 < int(row["convgrad_kernel_calls"]) <= int(row["convgrad_hlo_calls"])
        assert row["note"] == ""
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["command"].startswith("python -m benchmarks.jax_train_step")
    assert results["threads"][0]["pjrt_nproc"] == "1"


def test_models_have_torchvisions_layers_and_parameter_counts():
    """The full-size models: torchvision's convolution and parameter counts (BatchNorm's
    scale and bias counted, as torchvision's weight and bias)."""
    for build, convolutions, parameters in ((jax_models.resnet18, 20, 11_689_512),
                                            (jax_models.mobilenet_v2, 52, 3_504_872)):
        model = build()
        assert model.convolutions == convolutions
        assert sum(np.size(leaf) for leaf in jax.tree.leaves(model.params)) == parameters
