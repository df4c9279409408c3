"""The in-process A/B benchmark times two builds of one kernel and reports their ratio."""

from __future__ import annotations

import pytest

from benchmarks import ab_builds


def test_two_builds_of_a_layer_are_timed_against_each_other(capsys):
    """The base build runs with --base-env (here a whole build against this process's
    own): a line per layer and op with both times and their ratio, then the geomean."""
    status = ab_builds.main(["--layers", "res2a_branch2a", "--ops", "fwd",
                             "--batch", "1", "--reps", "2", "--seconds", "0.01",
                             "--base-env", "CONVGRAD_BUILD_JOBS=1"])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["resnet_50:res2a_branch2a", "fwd", "1T"]
    assert lines[1].startswith("geomean speed ours/theirs")
    ratios = [float(line.split()[-1]) for line in lines]
    assert len(ratios) == 2 and all(0.2 < ratio < 5 for ratio in ratios)


def test_a_layer_name_that_matches_nothing_is_an_error(capsys):
    assert ab_builds.main(["--layers", "no_such_layer"]) == 1
    assert "no layer" in capsys.readouterr().out


def test_shapes_file_gives_the_layers_of_ones_own_list(tmp_path, capsys):
    """--shapes-file takes the layers of a benchdnn file instead of a set's (--layers
    still picks among them); a missing file is a usage error."""
    shapes = tmp_path / "mine.txt"
    shapes.write_text('mb1ic8ih9oc16oh9kh3ph1n"mine:small"\nmb1ic8ih9oc8oh9kh1n"mine:other"\n')
    status = ab_builds.main(["--shapes-file", str(shapes), "--layers", "small",
                             "--ops", "weights", "--reps", "2", "--seconds", "0.01"])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[:-1]] == [["mine:small", "weights", "1T"]]
    with pytest.raises(SystemExit):
        ab_builds.parse_args(["--shapes-file", str(tmp_path / "missing.txt")])
