"""Property tests over the whole config schema, generated from the dataclass fields.

For every field of :class:`MoEConfig`, :class:`ModelConfig`, :class:`TrainConfig` and :class:`DataConfig`
(and the run's ``name``), random values of a wrong type or out of range go through
``mhmoe train --set FIELD=VALUE``: each must end with exit status 2 and one line on stderr naming the
field, never a traceback. The values are drawn per declared type (an ``int`` field gets non-integral
floats, booleans, null, strings, lists, mappings, negative and beyond-int64 integers; a ``float`` field
gets non-finite and negative numbers and the wrong types; an enumerated ``str`` field gets strings
outside its choices; ...). Every numeric field of the schema accepts no negative value, which the
first test checks too.

A second property runs a grid of in-type boundary values (0, 1, 2, huge, ...) through the config alone:
each is either accepted or refused with a ``ConfigError`` whose message names the field (a cross-field
rule may name its partner, e.g. ``top_k`` for ``n_experts``, but the message still mentions the field).

The draws are seeded (``MHMOE_SCHEMA_SEED``, default 0; every failure message shows the seed).
"""

from __future__ import annotations

import math
import os
import random
import typing
from dataclasses import fields

import pytest
import yaml

from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError

SEED = int(os.environ.get("MHMOE_SCHEMA_SEED", "0"))
PRESET = "tiny-mh3"  # an MH-MoE preset: every MoE field is checked (a dense one skips the routing fields)
SECTIONS = {"model.moe": MoEConfig, "model": ModelConfig, "train": TrainConfig, "data": DataConfig}
FREE_TEXT = {"name", "data.corpus", "data.jsonl_field", "data.cache_dir"}  # any string is a valid value...
EMPTY_OK = {"data.cache_dir"}  # ... and "" too ("" = the default cache)
PER_FIELD = 3  # random wrong values per field through the CLI


def schema() -> list[tuple[str, str]]:
    """(dotted field, declared type) for every leaf field of the run config."""
    out = [("name", "str")]
    for prefix, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if typing.get_origin(hints[f.name]) is typing.Literal:  # an option: an enumerated str
                kind = "str"
            if kind != "MoEConfig":
                out.append((f"{prefix}.{f.name}", kind))
    return out


def _word(rng: random.Random) -> str:
    return "zz-" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))


def _wrong_types(kind: str, rng: random.Random) -> list:
    """Values that are not of type ``kind`` (YAML-representable)."""
    pool = {"str": _word(rng), "list": [rng.randint(0, 9)], "map": {_word(rng): rng.randint(0, 9)}, "bool": True,
            "null": None, "float": rng.uniform(-1e6, 1e6) + 0.25, "int": rng.randint(2, 10**6)}
    excluded = {"int": {"int"}, "float": {"int", "float"}, "float | None": {"int", "float", "null"},
                "bool": {"bool"}, "bool | None": {"bool", "null"}, "str": {"str"},
                "tuple[str, ...]": {"str", "list"}}[kind]
    return [v for k, v in pool.items() if k not in excluded]


def _out_of_range(field: str, kind: str, rng: random.Random) -> list:
    """Values of the right type that no field of the schema accepts."""
    if kind == "int":
        return [rng.randint(-10**12, -1), 2**rng.randint(63, 200), -(2**rng.randint(63, 200))]
    if kind in ("float", "float | None"):
        return [math.inf, -math.inf, math.nan, -rng.uniform(1e-9, 1e9), Raw(f"1.0e+{rng.randint(309, 999)}")]
    if kind == "str":
        return ([] if field in EMPTY_OK else [""]) + ([] if field in FREE_TEXT else [_word(rng)])
    if kind == "tuple[str, ...]":
        return [[""], [rng.randint(0, 9)], [_word(rng), None]]
    return []


class Raw(str):
    """``--set`` text used as is (a float literal beyond the float range: YAML reads it as inf)."""


def _yaml(value) -> str:
    """The ``--set`` text that YAML reads back as ``value``."""
    if isinstance(value, Raw):
        return str(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).split("\n...")[0].strip()


def _bad_values(field: str, kind: str, rng: random.Random) -> list:
    values = _wrong_types(kind, rng) + _out_of_range(field, kind, rng)
    return rng.sample(values, min(PER_FIELD, len(values)))


def _one_line_naming(err: str, field: str, where: str) -> None:
    assert err.count("\n") == 1 and err.startswith("mhmoe train: error: "), f"{where}: {err!r}"
    assert "Traceback" not in err and f"invalid {field}=" in err, f"{where}: {err!r}"


def test_schema_is_complete():
    """Every declared type is one the generators know (a new field type must get wrong values too)."""
    kinds = {k for _, k in schema()}
    assert kinds <= {"int", "float", "float | None", "bool", "bool | None", "str", "tuple[str, ...]"}, kinds
    assert len(schema()) > 80


@pytest.mark.parametrize("section", ["name", *SECTIONS])
def test_wrong_values_through_the_cli_exit_2_naming_the_field(section, tmp_path, capsys):
    rng, base = random.Random(f"{SEED}-{section}"), get_preset(PRESET)
    out = tmp_path / "out"
    cases = 0
    for field, kind in schema():
        if field.rsplit(".", 1)[0] != section and field != section:
            continue
        for value in _bad_values(field, kind, rng):
            raw = _yaml(value)
            where = f"--set {field}={raw} (MHMOE_SCHEMA_SEED={SEED})"
            with pytest.raises(ConfigError):  # refused by the config (else main() would start training)
                base.with_overrides([f"{field}={raw}"])
            rc = main(["train", "--preset", PRESET, "--out", str(out), "--no-progress", "--set", f"{field}={raw}"])
            assert rc == 2, where
            _one_line_naming(capsys.readouterr().err, field, where)
            assert not out.exists(), where
            cases += 1
    assert cases >= 3


GRID = [0, 1, 2, 3, 7, 0.5, 0.999, 1.0, 1e-12, 10**9, 2**62, 1e300]


def test_in_type_boundary_values_are_accepted_or_name_the_field():
    base = get_preset(PRESET)
    refused = 0
    for field, kind in schema():
        if kind not in ("int", "float", "float | None"):
            continue
        leaf = field.rsplit(".", 1)[-1]
        for value in GRID:
            if kind == "int" and not float(value).is_integer():
                continue
            raw = _yaml(value)
            try:
                run = base.with_overrides([f"{field}={raw}"])
            except ConfigError as exc:
                refused += 1
                assert leaf in str(exc) and "\n" not in str(exc), f"--set {field}={raw}: {exc}"
                continue
            assert isinstance(run, RunConfig)
    assert refused > 20  # the grid reaches the range checks
