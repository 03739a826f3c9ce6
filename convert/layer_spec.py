"""The `--layers` grammar: which layers of an L-layer model a mixer replaces.

    all | none | ITEM[,ITEM...]      ITEM = I | A-B | A-B:S
    auto:N                           the N layers that matter least, measured (see layer_choice.py)

`A-B` is inclusive, `A-B:S` steps by S (`0-23:5` is 0,5,10,15,20); negative indices count from the end
(`-1` is the last layer, `-4--1` the last four).
"""

from __future__ import annotations

import re

ACCEPTED_FORMS = "'all', 'none', 'I', 'A-B', 'A-B:S' and comma-separated mixtures such as '0-3,8,12-20:4'"
AUTO_FORM = "'auto:N' (the N layers that matter least, measured; N from 1 to the number of layers - 1)"
_ITEM = re.compile(r"^(-?\d+)(?:-(-?\d+)(?::(\d+))?)?$")


class LayerSpecError(ValueError):
    """A `--layers` value that does not describe a set of layers of the model."""

    def __init__(self, spec: str, num_layers: int, problem: str, option: str = "--layers"):
        super().__init__(
            f"{option} {spec!r}: {problem}. The model has {num_layers} layers (indices 0..{num_layers - 1}, "
            f"or -{num_layers}..-1 from the end); accepted forms: {ACCEPTED_FORMS}."
        )


def parse_layer_spec(spec: str, num_layers: int, option: str = "--layers") -> list[int]:
    """Sorted layer indices named by `spec` for a model of `num_layers` layers; errors name `option`."""
    text = spec.strip().lower()
    if text == "all":
        return list(range(num_layers))
    if text == "none":
        return []
    if not text:
        raise LayerSpecError(spec, num_layers, "the spec is empty", option)

    def index(raw: str) -> int:
        i = int(raw)
        if not -num_layers <= i < num_layers:
            raise LayerSpecError(spec, num_layers, f"layer {i} is out of range", option)
        return i % num_layers

    layers: list[int] = []
    for item in text.split(","):
        item = item.strip()
        match = _ITEM.match(item)
        if not match:
            problem = "an empty item" if not item else f"{item!r} is not a layer, range or stepped range"
            raise LayerSpecError(spec, num_layers, problem, option)
        start, end, step = match.groups()
        if end is None:
            layers.append(index(start))
            continue
        a, b = index(start), index(end)
        if a > b:
            raise LayerSpecError(spec, num_layers, f"range {item!r} is reversed ({a} > {b})", option)
        if step is not None and int(step) < 1:
            raise LayerSpecError(spec, num_layers, f"step in {item!r} must be >= 1", option)
        layers.extend(range(a, b + 1, int(step or 1)))

    duplicates = sorted({i for i in layers if layers.count(i) > 1})
    if duplicates:
        raise LayerSpecError(spec, num_layers, f"layer(s) {duplicates} are named more than once", option)
    return sorted(layers)


def auto_count(spec: str, num_layers: int | None = None, option: str = "--layers") -> int | None:
    """N of an `auto:N` spec, or None for any other spec. N must be a whole number from 1 to num_layers - 1 (a
    hybrid keeps at least one attention layer); without num_layers only N >= 1 is checked (ValueError naming
    `option`)."""
    text = spec.strip().lower()
    if not text.startswith("auto"):
        return None
    number = text.removeprefix("auto").removeprefix(":").strip()
    top = f"{num_layers - 1} (the model has {num_layers} layers;" if num_layers else "the number of layers - 1 (as"
    allowed = f"auto:N with N a whole number from 1 to {top} one must keep attention)"
    if not number.isdigit():
        problem = f"{number!r} is not a number of layers" if number else "N is missing"
        raise ValueError(f"{option} {spec!r}: {problem}; expected {allowed}")
    n = int(number)
    if n < 1 or (num_layers is not None and n > num_layers - 1):
        raise ValueError(f"{option} {spec!r}: N = {n} is out of range; expected {allowed}")
    return n
