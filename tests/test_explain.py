"""`convgrad explain` and the resolved plan: which variant a layer gets, and overrides
that the chosen variant does not take are errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.layers import Layer
from convgrad.codegen.plan import Variant, resolve_plan
from convgrad.explain import explain

ROOT = Path(__file__).resolve().parent.parent

# (layer, isa, expected variant): a layer of each family, with the rules for an AMD CPU
LAYERS = [
    (Layer("ConvolutionBackwardData", ((8, 56, 56, 64), (3, 3, 64, 64)),
           {"pads_begin": 1, "pads_end": 1}, name="3x3"), "avx512", Variant.DIRECT),
    (Layer("ConvolutionBackwardData", ((8, 56, 56, 64), (7, 7, 3, 64), (112, 112)),
           {"strides": 2, "pads_begin": 3, "pads_end": 2}, name="conv1"), "avx2",
     Variant.COL2IM),
    (Layer("ConvolutionBackwardWeights", ((8, 28, 28, 96), (8, 28, 28, 96), (3, 3)),
           {"pads_begin": 1, "pads_end": 1, "groups": 96}, name="depthwise"), "avx512",
     Variant.DEPTHWISE_WEIGHTS),
    (Layer("ConvolutionBackwardData", ((8, 28, 28, 96), (3, 3, 1, 96)),
           {"pads_begin": 1, "pads_end": 1, "groups": 96}, name="depthwise data"), "avx2",
     Variant.ACROSS_GROUPS),
    (Layer("ConvolutionBackwardWeights", ((8, 14, 14, 256), (8, 14, 14, 256), (3, 3)),
           {"pads_begin": 1, "pads_end": 1, "groups": 64}, name="grouped"), "avx512",
     Variant.GROUPED_WEIGHTS),
    (Layer("ConvolutionBackwardWeights", ((8, 64, 56, 56), (8, 64, 56, 56), (1, 1)),
           {"data_format": "NCX", "weights_format": "OIX"}, name="NCX 1x1"), "avx2",
     Variant.WEIGHTS),
]


@pytest.mark.parametrize("layer,isa,variant", LAYERS, ids=[layer.name for layer, *_ in LAYERS])
def test_explain_names_the_variant_a_layer_takes(layer, isa, variant):
    found = explain(layer, isa=isa, vendor="AuthenticAMD")
    assert found.resolved.variant is variant
    text = str(found)
    assert f"variant    {variant.name.lower()} ({variant.value})" in text
    assert "kernel.c.j2" in found.templates and variant.value in found.templates
    assert found.templates.index("kernel.c.j2") < found.templates.index(variant.value)


def test_an_override_the_variant_does_not_take_raises():
    """ncx_dot (the dot-product variant's choice) on a strided-w layer, which the dot
    kernel cannot run, and a data-gradient choice on a weight gradient, are errors that
    name the variant and the choices it takes; the same overrides where they apply
    resolve to the variant they choose."""
    def config(strides=(1, 1), family="bwd_weights", kernel=(1, 1)):
        return KernelConfig(family, kernel, strides, (1, 1), 1, 64, 64, "NCX", "OIX",
                            "f32", "avx2")

    with pytest.raises(ValueError, match=r"weights variant \(bwd_weights.c.j2\) does not "
                                         r"read \['ncx_dot'\]; here it takes \[.*vec_block"):
        resolve_plan(config(strides=(1, 2)), {"ncx_dot": 1})
    with pytest.raises(ValueError, match=r"does not read \['band_kb'\]"):
        resolve_plan(config(), {"band_kb": 1})
    assert resolve_plan(config(), {"ncx_dot": 1}).variant is Variant.WEIGHTS_DOT
    assert resolve_plan(config(family="bwd_data", kernel=(3, 3)),
                        {"band_kb": 1}).choices["band_bytes"] > 0


def test_explain_command_on_a_layer_file_and_on_one_op():
    env_run = [sys.executable, "-m", "convgrad", "explain"]
    shown = subprocess.run([*env_run, "--layer", "res2a_branch2b", "--isa", "avx2",
                            "--vendor", "AuthenticAMD"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    assert shown.count("variant    direct (direct.c.j2)") == 1
    assert "ConvolutionBackwardWeights" in shown and "templates  kernel.c.j2" in shown
    one = subprocess.run([*env_run, "--op", "ConvolutionBackwardData", "--inputs", "1,8,8,16",
                          "3,3,16,16", "--attrs", '{"pads_begin": 1, "pads_end": 1}',
                          "--plan", '{"vec_block": 1}', "--isa", "avx2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert '{"vec_block": 1} (given)' in one and "vec_block = 1:" in one
    bad = subprocess.run([*env_run, "--op", "ConvolutionBackwardData", "--inputs", "1,8,8,16",
                          "3,3,16,16", "--plan", '{"packed": 1}', "--isa", "avx2"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "does not read ['packed']" in bad.stderr


def test_explain_one_op_takes_the_data_format(capsys):
    """With --op, --data-format sets the layout (the inputs in it), as the attribute
    does; the two disagreeing is a usage error."""
    from convgrad import cli

    one = ["explain", "--op", "ConvolutionBackwardWeights", "--inputs", "2,3,16,16",
           "2,8,8,8", "--attrs", '{"strides": 2, "pads_begin": 1, "pads_end": 1, '
           '"weights_shape": [3, 3, 3, 8]}', "--isa", "avx2"]
    assert cli.main([*one, "--data-format", "NCX"]) == 0
    assert "f32, NCX data" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*one[:-2], "--data-format", "NXC", "--attrs",
                  '{"data_format": "NCX", "weights_shape": [3, 3, 3, 8]}'])
    assert "disagree" in capsys.readouterr().err


def test_explain_ops_by_short_name_and_an_unknown_one(capsys):
    """--ops takes the benchmark's short names (fwd: ConvTransposeBackwardData); an
    unknown one is a usage error that lists the valid ones."""
    from convgrad import cli

    assert cli.main(["explain", "--layer", "res5a_branch1", "--ops", "fwd",
                     "--isa", "avx2"]) == 0
    assert "res5a_branch1: ConvTransposeBackwardData" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        cli.main(["explain", "--ops", "forward"])
    assert usage.value.code == 2
    assert "unknown op kind(s) ['forward']" in capsys.readouterr().err


# Configurations whose kernels carry the paths that a record's optional choices belong to
# (LAYERS' carry neither): the AMX path (bf16, one group, channels in multiples of 32, on
# avx512bf16; the planner needs no AMX CPU) and channels-first 1x1 tiles (NCX f32 1x1).
CARRYING = [
    (KernelConfig("bwd_data", (1, 1), (1, 1), (1, 1), 1, 64, 96, "NXC", "XIO", "bf16",
                  "avx512bf16"), Variant.DIRECT),
    (KernelConfig("bwd_weights", (3, 3), (1, 1), (1, 1), 1, 64, 96, "NXC", "XIO", "bf16",
                  "avx512bf16"), Variant.WEIGHTS),
    (KernelConfig("bwd_data", (1, 1), (1, 1), (1, 1), 1, 64, 256, "NCX", "XIO", "f32",
                  "avx2"), Variant.DIRECT),
]
# An optional choice (a field that defaults to None) by its prefix: the record's flag
# that says whether the kernel carries its path (codegen/choices.py).
OPTIONAL_PATHS = {"amx_": "amx", "ncx_": "pointwise_ncx"}


def test_each_variant_resolves_to_its_typed_record():
    """A resolved plan's choices are its family's frozen record: a choice the family does
    not have, one missing or one of the wrong type is refused. Its keys are every choice
    the family always has (none left None, even where False or 0) and the optional
    choices of exactly the paths the kernel carries (AMX, channels-first 1x1 tiles):
    those of a path it does not carry are not among them."""
    import dataclasses

    from convgrad.codegen.choices import DirectChoices, WeightChoices
    from convgrad.codegen.variants import RECORDS

    carried = set()
    for config, variant in [*((layer.resolve().config.with_isa(isa), variant)
                              for layer, isa, variant in LAYERS), *CARRYING]:
        record = resolve_plan(config).choices
        assert type(record) is RECORDS[variant]
        # a variant's fixed values (choices.fixed) are no choices: not keys, but values
        # its templates read
        fields = [f for f in dataclasses.fields(record) if f.init]
        fixed = {f.name for f in dataclasses.fields(record) if not f.init}
        assert not fixed & set(record)
        assert fixed <= set(record.template_values())
        always = {f.name for f in fields if f.default is dataclasses.MISSING}
        optional = {f.name for f in fields} - always
        paths = {name: OPTIONAL_PATHS[name[:name.index("_") + 1]] for name in optional}
        applies = {name for name, flag in paths.items() if record[flag]}
        assert set(record) == always | applies, config
        assert all(record[name] == getattr(record, name) for name in record)
        carried |= {paths[name] for name in applies}
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.tiles = ()  # type: ignore[misc]
    assert carried == set(OPTIONAL_PATHS.values())  # each path's choices present somewhere
    config = LAYERS[0][0].resolve().config.with_isa("avx2")
    choices = dict(resolve_plan(config).choices)
    assert "amx_pack" not in choices and not choices["amx"]
    with pytest.raises(TypeError, match="unexpected keyword"):
        DirectChoices(**choices, chunk_pixels=1)
    with pytest.raises(TypeError, match="missing"):
        DirectChoices(**{k: v for k, v in choices.items() if k != "tile_rows"})
    with pytest.raises(TypeError, match="tile_rows"):
        DirectChoices(**{**choices, "tile_rows": True})
    with pytest.raises(TypeError, match="unexpected keyword"):
        WeightChoices(**choices)


def test_explain_names_the_rules_that_chose_the_configuration():
    """The problem's own rules (codegen/rules_problem.py) show where they changed the
    kernel: avx512 narrowed to avx2 for 3 vector channels, a 1x1 NCX weight gradient run
    with its inputs swapped; neither where they did not."""
    narrow = Layer("ConvolutionBackwardData", ((8, 56, 56, 64), (7, 7, 3, 64), (112, 112)),
                   {"strides": 2, "pads_begin": 3, "pads_end": 2})
    swapped = Layer("ConvolutionBackwardWeights", ((8, 64, 56, 56), (8, 256, 56, 56), (1, 1)),
                    {"data_format": "NCX"})
    found = explain(narrow, isa="avx512", vendor="")
    assert found.config.isa == "avx2" and "rules_problem.narrowed_isa" in str(found)
    found = explain(swapped, isa="avx512", vendor="")
    assert (found.config.cin_per_group, found.config.cout_per_group) == (256, 64)
    assert "rules_problem.swaps_operands" in str(found)
    plain = explain(LAYERS[0][0], isa="avx512", vendor="")
    assert not plain.problem_rules and "problem " not in str(plain)
    # a squeeze-and-excitation convolution: one pixel an image, few multiply-adds
    squeeze = Layer("ConvTransposeBackwardData", ((8, 1, 1, 144), (1, 1, 144, 6)), {})
    assert "variants.small_problem_plan" in str(explain(squeeze, isa="avx512", vendor=""))
    assert "small_problem_plan" not in str(plain)


# The choices a variant's branch of variants._body sets itself (no rule function).
BODY_CHOICES = {"ncx_second_part", "no_scratch", "second_part", "compute_scratch",
                "vector_per_group", "reduced_per_group", "spread_whole_bytes",
                "round_in_tiles", "pointwise_ncx", "overlap_runs", "pad_columns_below",
                "column_runs", "input_in_place", "image_block_bytes"}


@pytest.mark.parametrize("layer,isa,variant", LAYERS, ids=[layer.name for layer, *_ in LAYERS])
def test_explain_attributes_every_choice_to_its_rule(layer, isa, variant):
    """Every derived choice is attributed to the rule function that returns it, but for a
    few the variant's branch sets itself; the rule of the vector block is named."""
    from convgrad import rule_notes

    found = explain(layer, isa=isa, vendor="AuthenticAMD")
    attributed = [c for choices in found.rules.values() for c in choices]
    assert sorted(attributed) == sorted(found.resolved.choices)  # each once
    assert set(found.rules.get(rule_notes.BODY, ())) <= BODY_CHOICES
    if "vec_block" in found.resolved.choices:
        assert any("vec_block" in choices for rule, choices in found.rules.items()
                   if rule != rule_notes.BODY)


def test_explain_notes_give_each_rules_constants_and_their_measurements():
    """--notes: the constants a rule reads (through its helpers too), with the comment
    above each, which holds the measurements that set it."""
    found = explain(LAYERS[0][0], isa="avx512", vendor="AuthenticAMD", with_notes=True)
    direct = {note.name: note for note in found.notes["rules_data.direct_tiles"]}
    assert direct["WEIGHT_CHUNK_BYTES"].value == 512 * 1024
    assert "L2" in direct["WEIGHT_CHUNK_BYTES"].comment
    assert "GFLOP/s" in direct["LONG_TILE_ACCUMULATORS"].comment
    assert "WEIGHT_CHUNK_BYTES = 524288 (rules_data): half of a 1 MB L2" in str(found)
    assert not explain(LAYERS[0][0], isa="avx512", vendor="AuthenticAMD").notes
