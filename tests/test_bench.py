"""The benchmark command runs end to end on a tiny setting and writes its outputs."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import bench, cases, pair_plans
from benchmarks import shapes as bench_shapes

pytest.importorskip("torch")
pytest.importorskip("matplotlib")


@pytest.mark.parametrize("weights_format", [[], ["--weights-format", "OIX"]])
def test_benchmark_writes_table_csv_json_and_plot(tmp_path, capsys, weights_format):
    """A run writes its table, CSV, JSON and plot, and convgrad's results agree with
    PyTorch's, in XIO and in PyTorch's own OIX weights."""
    status = bench.main(["--set", "resnet50", "--limit", "1", "--threads", "1",
                         "--min-time", "0.01", "--batch", "1", "--out", str(tmp_path),
                         *weights_format])
    assert status == 0
    printed = capsys.readouterr().out
    assert "FMA peak" in printed and "geometric mean" in printed
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert {row["op"] for row in rows} == {"data", "weights"}
    for row in rows:
        assert float(row["ours_gflops"]) > 0 and float(row["torch_gflops"]) > 0
        assert not row["note"].startswith("MISMATCH")
        # the shares of a peak measured next to the row: the fastest call's no less
        assert float(row["peak_gflops"]) > 0
        assert float(row["ours_best_pct_peak"]) >= float(row["ours_pct_peak"]) > 0
        assert float(row["ours_best_gflops"]) >= float(row["ours_gflops"])
        assert float(row["ours_faults_per_call"]) >= 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["peak_f32_gflops_per_core"] > 0
    assert (tmp_path / "results.png").stat().st_size > 0


def test_amx_peak_only_where_the_kernels_may_use_amx(monkeypatch):
    """The AMX tile peak is measured on the avx512bf16 path of a CPU with AMX-BF16 (and
    there reads far above the f32 FMA peak: 16 x 16 x 32 multiply-adds per tile
    instruction), and never on a lesser path or with CONVGRAD_AMX=0."""
    from benchmarks.machine import Peak
    from convgrad.codegen.isa import AMX_FEATURES
    from convgrad.cpu import available_isas, cpu_features

    assert Peak("avx2", amx=True).amx is None
    if "avx512bf16" not in available_isas() or not cpu_features() >= AMX_FEATURES:
        pytest.skip("this CPU has no AMX-BF16")
    peak = Peak("avx512bf16", amx=True)
    assert peak.amx is not None and peak.amx.measure(0.01, 3) > 4 * peak.measure(0.01, 3)
    assert Peak("avx512bf16").amx is None
    monkeypatch.setenv("CONVGRAD_AMX", "0")
    assert Peak("avx512bf16", amx=True).amx is None


def test_bf16_rows_give_their_share_of_the_amx_peak(tmp_path):
    """On a CPU with AMX-BF16, a bf16 row gives both libraries' shares of the tile peak
    measured next to it: GFLOP/s over (that peak x threads)."""
    from convgrad.codegen.isa import AMX_FEATURES
    from convgrad.cpu import available_isas, cpu_features

    if "avx512bf16" not in available_isas() or not cpu_features() >= AMX_FEATURES:
        pytest.skip("this CPU has no AMX-BF16")
    status = bench.main(["--set", "resnet50", "--layers", "res2a_branch2a", "--limit", "1",
                         "--threads", "1", "--ops", "fwd", "--dtype", "bf16",
                         "--min-time", "0.01", "--batch", "1", "--out", str(tmp_path)])
    assert status == 0
    (row,) = csv.DictReader((tmp_path / "results.csv").open())
    amx = float(row["amx_peak_gflops"])
    assert amx > 4 * float(row["peak_gflops"])
    for name in ("ours", "torch"):
        assert float(row[f"{name}_pct_amx_peak"]) == pytest.approx(
            100 * float(row[f"{name}_gflops"]) / amx)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["peak_amx_bf16_gflops_per_core"] > 0
    assert results["geomean"][0]["pct_amx_peak"] > 0


def test_alone_times_convgrad_pinned_without_torch_calls(tmp_path, monkeypatch):
    """--alone: PyTorch checks the result once but is not timed; while convgrad is
    timed, the process runs on as many CPUs as threads, and the affinity comes back."""
    import os

    allowed = os.sched_getaffinity(0)
    seen = []
    timed_calls = cases.timed_calls

    def recording(functions, *args, **kwargs):
        seen.append((len(functions), len(os.sched_getaffinity(0))))
        return timed_calls(functions, *args, **kwargs)

    monkeypatch.setattr(cases, "timed_calls", recording)
    status = bench.main(["--set", "resnet50", "--limit", "1", "--threads", "1", "--ops",
                         "data", "--min-time", "0.01", "--batch", "1", "--alone",
                         "--out", str(tmp_path)])
    assert status == 0
    assert seen == [(1, 1)]
    assert os.sched_getaffinity(0) == allowed
    (row,) = csv.DictReader((tmp_path / "results.csv").open())
    assert row["alone"] == "True" and row["torch_gflops"] == "" and row["ratio"] == ""
    assert float(row["max_rel_err"]) < 1e-3  # checked against PyTorch once


def test_tuned_plans_are_paired_with_the_rules_apart_from_torch(tmp_path, monkeypatch):
    """--tune times each tuned plan against the rules' plan in a pairing of its own (a
    call right after PyTorch's runs slower), and scales the rules' figures by that gain."""
    pairings = []
    timed_pair, timed_calls = cases.timed_pair, cases.timed_calls

    def recording(timing):
        def record(functions, *args, **kwargs):
            pairings.append([getattr(f, "__name__", "") for f in functions])
            return timing(functions, *args, **kwargs)
        return record

    monkeypatch.setattr(cases, "timed_pair", recording(timed_pair))
    monkeypatch.setattr(cases, "timed_calls", recording(timed_calls))
    status = bench.main(["--set", "resnet50", "--limit", "1", "--threads", "1", "--ops",
                         "weights", "--min-time", "0.01", "--batch", "1", "--tune",
                         "--out", str(tmp_path)])
    assert status == 0
    assert ["<lambda>", "torch_call"] in pairings and ["<lambda>", "<lambda>"] in pairings
    assert all(len(names) == 2 for names in pairings)
    (row,) = csv.DictReader((tmp_path / "results.csv").open())
    gain = float(row["tuned_gain"])
    assert gain > 0 and row["tuned_plan"]
    assert float(row["tuned_gflops"]) == pytest.approx(float(row["ours_gflops"]) * gain)
    assert float(row["tuned_ratio"]) == pytest.approx(float(row["ratio"]) * gain)


def test_rounds_report_the_median_of_each_row():
    """--rounds N: each (layer, op, threads) row takes the median of each library's
    times and of the rounds' ratios; calls add up, the first round's first call stays."""
    def row(ours_ms, torch_ms, peak, first=None):
        ours, theirs = 2e6 / ours_ms / 1e6, 2e6 / torch_ms / 1e6
        return cases.Row("s", "layer", "data", 1, 8, "f32", "NXC", flops=2_000_000,
                         torch_flops=2_000_000, ours_ms=ours_ms, torch_ms=torch_ms,
                         ours_gflops=ours, torch_gflops=theirs, ratio=ours / theirs,
                         ours_best_gflops=2 * ours, torch_best_gflops=theirs,
                         ours_calls=3, torch_calls=4, ours_pct_peak=ours, first_call_ms=first,
                         peak_gflops=peak)

    # the rounds' median peak is 100 GFLOP/s per core: a share of peak in % equal to
    # the GFLOP/s
    rounds = [[row(1.0, 2.0, 50.0, first=300.0)], [row(4.0, 2.0, 100.0)],
              [row(2.0, 1.0, 120.0)]]
    (merged,) = cases.merge_rounds(rounds)
    assert merged.ours_ms == 2.0 and merged.torch_ms == 2.0
    assert merged.ratio == 0.5  # the rounds' ratios 2, 0.5, 0.5 (not 2.0 / 2.0)
    assert merged.ours_gflops == 1.0 and merged.torch_gflops == 1.0
    assert merged.peak_gflops == 100.0 and merged.ours_pct_peak == 1.0  # median GFLOP/s
    assert merged.ours_best_gflops == 4.0 and merged.ours_best_pct_peak == 4.0  # fastest
    assert merged.ours_best_ms == 0.5
    assert (merged.ours_calls, merged.torch_calls, merged.first_call_ms) == (9, 12, 300.0)
    assert cases.merge_rounds(rounds[:1]) == rounds[0]


def test_rounds_run_every_case_again(tmp_path, capsys):
    """A run of two rounds times each case twice and writes one row per case."""
    status = bench.main(["--set", "resnet50", "--limit", "1", "--threads", "1", "--ops",
                         "data", "--min-time", "0.01", "--batch", "1", "--rounds", "2",
                         "--out", str(tmp_path)])
    assert status == 0
    assert capsys.readouterr().err.count("round 2: ") == 1
    (row,) = csv.DictReader((tmp_path / "results.csv").open())
    assert int(row["ours_calls"]) >= 6 and not row["note"].startswith("MISMATCH")


def test_shapes_file_runs_every_layer_of_ones_own_list(tmp_path, capsys):
    """--shapes-file runs the layers of a benchdnn file of one's own (all of them, or
    those --layers names), labelled by the file; a missing file is an error."""
    shapes = tmp_path / "stems.txt"
    shapes.write_text('# two stems\nmb2ic3ih12oc8oh12kh3ph1n"vgg:conv1_1"\n'
                      'mb2ic3ih12oc4oh6kh3sh2ph1n"mobilenet:conv1"\n')
    status = bench.main(["--shapes-file", str(shapes), "--threads", "1", "--ops", "weights",
                         "--min-time", "0.01", "--data-format", "NCX",
                         "--out", str(tmp_path / "out")])
    assert status == 0
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").open()))
    assert [row["layer"] for row in rows] == ["vgg:conv1_1", "mobilenet:conv1"]
    assert not any(row["note"].startswith("MISMATCH") for row in rows)
    assert {row["shape_set"] for row in rows} == {"stems.txt"}
    settings = json.loads((tmp_path / "out" / "results.json").read_text())["settings"]
    assert settings["shapes_file"] == str(shapes)
    assert [c.name for c in bench_shapes.load_file(shapes, None, ["mobilenet"])] == [
        "mobilenet:conv1"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes-file", str(tmp_path / "missing.txt")])
    capsys.readouterr()


def test_pair_plans_times_each_plan_in_its_own_kernel(capsys, monkeypatch):
    """benchmarks.pair_plans runs every plan given in a kernel of its own on the
    benchmark's inputs, between PyTorch's calls, and prints each one's GFLOP/s and its
    ratio to the first plan's per repeat; a plan with an unknown choice is refused."""
    from convgrad import kernels

    loaded = []
    get_kernel = kernels.get_kernel

    def recording(config, plan=None):
        kernel = get_kernel(config, plan)
        loaded.append((plan, kernel.name))
        return kernel

    monkeypatch.setattr(kernels, "get_kernel", recording)
    status = pair_plans.main(["--layers", "res2a_branch2a", "--batch", "1", "--threads", "1",
                              "--min-time", "0.01", "--repeats", "2", "--plan", "{}",
                              "--plan", '{"packed": 1}'])
    assert status == 0
    assert [plan for plan, _ in loaded] == [{}, {"packed": 1}]
    assert loaded[0][1] != loaded[1][1]
    lines = [line.split() for line in capsys.readouterr().out.splitlines()
             if "GFLOP/s" in line and "ratio" in line and "torch" in line]
    assert [line[0] for line in lines] == ["1", "1", "2", "2"]
    for repeat in (lines[:2], lines[2:]):
        assert repeat[0][repeat[0].index("ratio") + 1] == "1.000"
        assert all(float(line[line.index("GFLOP/s") - 1]) > 0 for line in repeat)
    with pytest.raises(SystemExit):
        pair_plans.main(["--layers", "res2a_branch2a", "--plan", "{}",
                         "--plan", '{"no_such_choice": 1}'])


def test_pair_plans_runs_layers_given_as_benchdnn_descriptors(capsys):
    """--shapes: layers of no set (EfficientNet-B0's squeeze-and-excitation 1x1 on one
    pixel, as benchmarks/results/zen4/small_problem_plan_8e5cde8 timed them)."""
    status = pair_plans.main(["--shapes", "mb8ic96oc4_ih1oh1kh1sh1dh0ph0_iw1ow1kw1sw1dw0pw0",
                              "--op", "fwd", "--batch", "8", "--threads", "1", "--min-time",
                              "0.01", "--repeats", "1", "--no-torch", "--plan", "{}",
                              "--plan", '{"tile_rows": 2}'])
    assert status == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "ratio" in line
             and "GFLOP/s" in line and not line.startswith(("f32", "avx", "portable"))]
    assert len(lines) == 2 and lines[0][-1] == "1.000"


def test_scaling_reports_each_librarys_parallel_efficiency(tmp_path, capsys):
    """benchmarks.scaling times every op at each thread count against PyTorch at the
    same count; an efficiency is a library's GFLOP/s per thread over its own 1-thread
    figure (1 at 1 thread by definition), and the summary has one line per op and count."""
    from benchmarks import scaling

    assert scaling.default_threads()[0] == 1
    status = scaling.main(["--sets", "mobilenet_v2", "--limit", "1", "--ops", "data,fwd",
                           "--threads", "2", "--min-time", "0.01", "--batch", "1",
                           "--out", str(tmp_path)])
    assert status == 0
    rows = list(csv.DictReader((tmp_path / "scaling.csv").open()))
    assert sorted((r["op"], int(r["threads"])) for r in rows) == [
        ("data", 1), ("data", 2), ("fwd", 1), ("fwd", 2)]  # 1 added as the base
    for row in rows:
        ours, theirs = float(row["ours_gflops"]), float(row["torch_gflops"])
        assert ours > 0 and theirs > 0
        if row["threads"] == "1":
            assert float(row["ours_efficiency"]) == float(row["torch_efficiency"]) == 1.0
        else:
            one = next(r for r in rows if r["op"] == row["op"] and r["threads"] == "1")
            assert float(row["ours_efficiency"]) == pytest.approx(
                ours / 2 / float(one["ours_gflops"]))
    summary = json.loads((tmp_path / "scaling.json").read_text())["summary"]
    assert [(m["op"], m["threads"]) for m in summary] == [
        ("data", 1), ("data", 2), ("fwd", 1), ("fwd", 2)]
    assert "convgrad eff" in capsys.readouterr().out
