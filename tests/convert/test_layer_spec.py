"""The --layers grammar: every accepted form, and a clear error for every malformed one."""

import pytest

from raven_convert import LayerSpecError, parse_layer_spec


@pytest.mark.parametrize(
    ("spec", "layers"),
    [
        ("0-23:5", [0, 5, 10, 15, 20]),
        ("0-3", [0, 1, 2, 3]),
        ("1,5,9", [1, 5, 9]),
        ("0-3,8,12-20:4", [0, 1, 2, 3, 8, 12, 16, 20]),
        ("all", list(range(24))),
        ("ALL", list(range(24))),
        ("none", []),
        ("-1", [23]),
        ("-4--1", [20, 21, 22, 23]),
        ("0,-1", [0, 23]),
        (" 2 , 4 ", [2, 4]),
        ("7", [7]),
        ("5-5", [5]),
        ("0-23:30", [0]),
    ],
)
def test_accepted_forms(spec, layers):
    assert parse_layer_spec(spec, 24) == layers


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("24", "layer 24 is out of range"),
        ("-25", "layer -25 is out of range"),
        ("0-30", "layer 30 is out of range"),
        ("", "the spec is empty"),
        ("  ", "the spec is empty"),
        ("1,,2", "an empty item"),
        ("5-2", "range '5-2' is reversed (5 > 2)"),
        ("-1-0", "range '-1-0' is reversed (23 > 0)"),
        ("0-3,2", "layer(s) [2] are named more than once"),
        ("-1,23", "layer(s) [23] are named more than once"),
        ("0-4:0", "step in '0-4:0' must be >= 1"),
        ("a-b", "'a-b' is not a layer, range or stepped range"),
        ("3:2", "'3:2' is not a layer, range or stepped range"),
        ("1.5", "'1.5' is not a layer, range or stepped range"),
        ("0-3:-1", "'0-3:-1' is not a layer, range or stepped range"),
    ],
)
def test_malformed_specs_name_the_problem_the_layer_count_and_the_forms(spec, problem):
    with pytest.raises(LayerSpecError) as err:
        parse_layer_spec(spec, 24)
    message = str(err.value)
    assert problem in message
    assert "The model has 24 layers (indices 0..23, or -24..-1 from the end)" in message
    assert "accepted forms: 'all', 'none', 'I', 'A-B', 'A-B:S'" in message
