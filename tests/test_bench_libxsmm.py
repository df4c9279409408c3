"""benchmarks.libxsmm: LIBXSMM-DNN's driver's arguments and output, and a run against a
stand-in driver (the real one is built from source outside the repository)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from benchmarks import libxsmm
from benchmarks.shapes import DEFAULT_SHAPES_DIR, load_sets
from convgrad.cpu import available_isas


def layer(name: str):
    ((_, conv),) = load_sets(["resnet50"], DEFAULT_SHAPES_DIR, None, [name])
    return conv


def test_driver_arguments_spell_the_layer_in_the_drivers_order():
    """iters W H N C K S R padw padh stride, all passes, LIBXSMM layout, padding mode,
    no fusion, blocks, f32; conv1's asymmetric pads give the driver's output size."""
    assert libxsmm.driver_arguments(layer("res3a_branch1"), 8, 40, False, 64) == [
        "40", "56", "56", "8", "256", "512", "1", "1", "0", "0", "2",
        "A", "L", "0", "0", "64", "64", "4"]
    conv1 = libxsmm.driver_arguments(layer("conv1"), 2, 5, True, 32)
    assert conv1[1:11] == ["224", "224", "2", "3", "64", "7", "7", "3", "3", "2"]
    assert conv1[13] == "1" and conv1[15:17] == ["32", "32"]
    conv = layer("res2a_branch2b")
    for unsupported in (replace(conv, dilations=(2, 2)), replace(conv, groups=2),
                        replace(conv, strides=(1, 2)), replace(conv, pads_end=(0, 0),
                                                               dst=(55, 55))):
        assert libxsmm.driver_arguments(unsupported, 8, 5, False, 64) is None


def test_perfdump_lines_give_time_speed_and_check_per_pass():
    text = ("GFLOPS  = 99\n"
            "PERFDUMP,FP,1.17-3791,1,8,64,64,56,56,3,3,1,1,1,0.016915,109.35,25313.9,"
            "25313.9,0.000014,3.4,0.0000001,3.2,0.000001\n"
            "PERFDUMP,WU,1.17-3791,1,8,64,64,56,56,3,3,1,1,1,0.017161,107.78,3842.6,3842.6,"
            "0.000012,0.026,0.0000003,0.025,0.0000004\n")
    parsed = libxsmm.parse_perfdump(text)
    assert set(parsed) == {"FP", "WU"}
    assert parsed["FP"] == {"seconds": 0.016915, "gflops": 109.35, "normf_rel": 0.000001,
                            "version": "1.17-3791"}
    assert parsed["WU"]["normf_rel"] == 0.0000004


@pytest.mark.skipif("avx2" not in available_isas(), reason="needs an AVX2 CPU")
def test_run_against_a_stand_in_driver(tmp_path, capsys):
    """A round runs the driver pinned to as many CPUs as threads with OMP_NUM_THREADS
    set, then convgrad's calls; the ratio is convgrad's GFLOP/s over the driver's, and
    a pass the driver did not run is a note, not a ratio. --isa avx2 puts LIBXSMM's JIT
    on its AVX2 target (hsw) and convgrad's kernel on that path."""
    log = tmp_path / "calls.log"
    driver = tmp_path / "layer_example"
    driver.write_text(
        "#!/bin/sh\n"
        f'echo "$OMP_NUM_THREADS $(nproc) $LIBXSMM_TARGET $*" >> "{log}"\n'
        'echo "LIBXSMM_TARGET: stand-in"\n'
        'echo "PERFDUMP,WU,0.0-test,1,1,512,512,7,7,3,3,1,1,1,0.002,5.0,0,0,0,0,0,0,0.25"\n')
    driver.chmod(0o755)
    out = tmp_path / "out"
    status = libxsmm.main(["--driver", str(driver), "--layers", "res5a_branch2b",
                           "--ops", "weights,data", "--batch", "1", "--rounds", "1",
                           "--min-time", "0.01", "--isa", "avx2", "--out", str(out)])
    assert status == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 1  # one driver process a layer a round
    assert all(c.startswith("1 1 hsw ") and " 7 7 1 512 512 3 3 1 1 1 A L 0 " in c
               for c in calls)
    rows = {r["op"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    weights, data = rows["weights"], rows["data"]
    assert weights["libxsmm_ms"] == 2.0 and weights["libxsmm_normf_rel"] == 0.25
    assert abs(weights["ratio"] - weights["ours_gflops"] / weights["libxsmm_gflops"]) < 1e-9
    assert weights["ours_best_gflops"] >= weights["ours_gflops"] > 0
    assert data["ratio"] is None and "no BP pass" in data["note"]
    printed = capsys.readouterr().out
    assert "convgrad avx2 " in printed and "target stand-in" in printed
    assert "over 1 layers" in printed
    assert sorted(os.listdir(out)) == ["results.csv", "results.json", "table.txt"]
