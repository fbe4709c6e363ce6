"""Bounded YAML and JSON reading (:mod:`mhmoe.runtime.bounded`): bombs cost a small multiple of their
size and end in one bounded line naming the file.

The bombs that would exhaust this machine without limits run in a child process under RLIMIT_AS and
RLIMIT_CPU (``tests/bombs.py``), so a regression fails the test instead of taking the machine down."""

from __future__ import annotations

import json

import pytest
from bombs import billion_laughs, deep_json, run_limited

from mhmoe.config.run import RunConfig
from mhmoe.errors import MAX_CHARS, ConfigError
from mhmoe.runtime.bounded import (
    MAX_PICKLE_DEPTH,
    MAX_YAML_CHARS,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    BoundedLoadError,
    load_json,
    load_yaml,
    pickle_depth,
)

LIGHT_MB = 200  # a child that imports only mhmoe.config: ~25 MB of RSS; a bomb that expands needs far more


def _one_bounded_line(msg: str, names: str) -> None:
    assert "\n" not in msg and len(msg) <= 2 * MAX_CHARS and names in msg, msg


def test_plain_configs_load_as_before():
    text = "name: x\nmodel: {d_model: 64}\nlist: [1, 2]\nbase: &b {a: 1}\nmerged: {<<: *b, c: 2}\n"
    assert load_yaml(text) == {"name": "x", "model": {"d_model": 64}, "list": [1, 2], "base": {"a": 1},
                               "merged": {"a": 1, "c": 2}}
    assert load_yaml("x: &a 3\ny: *a\n") == {"x": 3, "y": 3}  # aliases within the budget are fine


@pytest.mark.parametrize(("text", "what"), [
    (billion_laughs(), "aliases are expanded"),
    ("a:\n" + "".join("  " * i + "b:\n" for i in range(1, MAX_YAML_DEPTH + 2)) + "  " * (MAX_YAML_DEPTH + 2) + "1\n",
     "nested deeper"),
    ("x: &x [1, *x]\n", "recursive"),
    ("train: {lr: 1}\nmodel: {}\ntrain: {lr: 2}\n", "duplicate key 'train' (line 3)"),
    ("model: {d_model: 1, d_model: 2}\n", "duplicate key 'd_model'"),
    ("x" * (MAX_YAML_CHARS + 1), "characters of YAML"),
    ("[" * 5000, "invalid YAML"),
])
def test_yaml_bombs_and_ambiguities_are_refused_naming_the_file(text, what):
    with pytest.raises(BoundedLoadError) as info:
        load_yaml(text, "runs/x/config.yaml")
    _one_bounded_line(str(info.value), "runs/x/config.yaml")
    assert what in str(info.value)


def test_the_node_budget_counts_expanded_aliases_exactly():
    """Root map 1 + key 1 + the anchored list 11 + key 1 + the list 1 + 11 per alias = 15 + 11 k nodes."""
    def text(k: int) -> str:
        return "a: &a [" + ", ".join(["1"] * 10) + "]\nb: [" + ", ".join(["*a"] * k) + "]\n"

    k = (MAX_YAML_NODES - 15) // 11
    assert len(load_yaml(text(k))["b"]) == k
    with pytest.raises(BoundedLoadError, match="aliases are expanded"):
        load_yaml(text(k + 1))


def test_json_nesting_and_size_are_refused_naming_the_file():
    for text in (deep_json(), "[" * 50_000):
        with pytest.raises(BoundedLoadError) as info:
            load_json(text, "ck/meta.json")
        _one_bounded_line(str(info.value), "ck/meta.json")
    with pytest.raises(BoundedLoadError, match="more than the 10 allowed"):
        load_json('{"a": 12345}', "x.json", max_chars=10)
    assert load_json('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


def test_run_configs_name_the_file_for_bombs_duplicates_and_emptiness(tmp_path):
    cases = {"laughs.yaml": (billion_laughs(), "aliases are expanded"),
             "twice.yaml": ("train: {lr: 0.001}\ntrain: {lr: 0.002}\n", "duplicate key 'train'"),
             "empty.yaml": ("\n", "this file is empty")}
    for name, (text, what) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as info:
            RunConfig.load(tmp_path / name)
        _one_bounded_line(str(info.value), str(tmp_path / name))
        assert what in str(info.value)
    with pytest.raises(ConfigError, match="a YAML scalar"):  # --set values go through the same reader
        RunConfig().with_overrides([f"train.lr={billion_laughs()}"])


def test_a_yaml_bomb_costs_a_few_mb_through_the_cli(tmp_path):
    """``mhmoe train --config BOMB``: exit 2 and one line naming the file, within ~1 s and a few MB. (Without
    the limits, the same 1 KB file made the config error embed a 351 MB value.)"""
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(billion_laughs())
    code = ("import sys\nfrom mhmoe.config.run import RunConfig\nfrom mhmoe.errors import ConfigError\n"
            f"try:\n    RunConfig.load({str(bomb)!r})\nexcept ConfigError as e:\n    print(e)\n    sys.exit(2)\n")
    out = run_limited(code, memory=1 << 30, cpu_s=20)
    assert out.status == 2, out.stderr[-2000:]
    _one_bounded_line(out.stdout.strip(), str(bomb))
    assert out.max_rss_mb < LIGHT_MB and out.seconds < 20, (out.max_rss_mb, out.seconds)


def test_deep_json_in_a_jsonl_corpus_and_a_lock_file_never_escapes(tmp_path):
    from mhmoe.train.lock import _parse

    assert _parse(deep_json(5000).encode()) == {}  # a stranger's .lock record: ignored, not a traceback
    rows = tmp_path / "corpus.jsonl"
    rows.write_text(json.dumps({"text": "fine"}) + "\n" + deep_json(20_000) + "\n")
    from mhmoe.data.userdata import load_jsonl

    with pytest.raises(ValueError) as info:
        load_jsonl(rows, "text")
    _one_bounded_line(str(info.value), f"{rows}:2")


def test_pickle_depth_follows_the_objects_a_pickle_builds():
    import pickle

    shared = (1, (2, (3,)))
    assert pickle_depth(pickle.dumps({"a": [shared, shared], "b": list(range(10_000))})) == 5  # dict>list>3 tuples
    assert pickle_depth(pickle.dumps(list(range(100_000)))) == 1  # batched APPENDS grow one list in place
    deep: object = 0
    for _ in range(MAX_PICKLE_DEPTH + 1):
        deep = (deep,)
    with pytest.raises(ValueError, match=f"deeper than {MAX_PICKLE_DEPTH}"):
        pickle_depth(pickle.dumps(deep))
    from bombs import deep_tuple_key

    with pytest.raises(ValueError, match="deeper"):
        pickle_depth(deep_tuple_key(3_000_000))  # linear: refused at level 65 of 3,000,000
