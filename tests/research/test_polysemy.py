"""ICML Fig. 7 analogue: WordNet sense counts, the group statistics and their permutation test on routing
whose answer is known, and ``mhmoe analyze --polysemy`` on a tiny trained run."""

import json

import pytest
import torch

from mhmoe.data import wordnet
from mhmoe.data.documents import CorpusUnavailableError
from mhmoe.errors import DataError
from mhmoe.research.analysis import RoutingRecord
from mhmoe.research.polysemy import (
    EXCLUDED,
    MONOSEMOUS,
    POLYSEMOUS,
    TRIVIAL_NOTE,
    classify_tokens,
    frequency_strata,
    permutation_pvalue,
    polysemy_report,
    polysemy_statistics,
    whole_words,
)

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
INDEX = {
    "noun": "bank n 2 1 @ 2 0 09213565 08420278  \nsea_bank n 1 1 @ 1 0 09213565  \ngoose n 3 1 @ 3 0 1 2 3  \n"
            "aardvark n 1 1 @ 1 0 02680814  \n",
    "verb": "bank v 1 1 @ 1 0 02039431  \nrun v 5 1 @ 5 0 1 2 3 4 5  \n",
    "adj": "",
    "adv": "",
}


def fake_wordnet(root):
    root.mkdir(parents=True, exist_ok=True)
    for pos, text in INDEX.items():
        (root / f"index.{pos}").write_text(HEADER + text)
    (root / "noun.exc").write_text("geese goose\naardvarks aardvark\n")
    (root / "verb.exc").write_text("ran run\n")
    return root


def test_sense_counts_sum_parts_of_speech_and_read_the_exception_lists(tmp_path):
    counts = wordnet.wordnet_sense_counts(fake_wordnet(tmp_path / "wn"))
    assert counts == {"bank": 3, "goose": 3, "geese": 3, "aardvark": 1, "aardvarks": 1, "run": 5, "ran": 5}
    assert "sea_bank" not in counts  # collocations are not single tokens


@pytest.mark.skipif(not (wordnet.WORDNET_DIR / "index.noun").is_file(), reason="apt-get install wordnet-base")
def test_installed_wordnet_counts():
    counts = wordnet.wordnet_sense_counts()
    assert counts["bank"] == 18 and counts["aardvark"] == 1 and "the" not in counts  # WordNet 3.0
    assert counts["geese"] == 3  # goose's 3 noun senses, through noun.exc


def test_missing_wordnet_names_the_package_and_bad_lines_are_refused(tmp_path):
    with pytest.raises(CorpusUnavailableError, match="apt-get install wordnet-base"):
        wordnet.wordnet_sense_counts(tmp_path / "nowhere")
    with pytest.raises(DataError, match="index.noun:2"):
        wordnet.parse_index(["bank n 2 1", "bank n two"], "index.noun")


def test_whole_words_need_word_boundaries_on_both_sides():
    texts = [" bank", "ing", " the", " Bank", ",", "run", "\n", "run", " 42", " naïve"]
    assert whole_words(texts) == [None, None, "the", "bank", None, "run", None, "run", None, None]


def test_classify_tokens_counts_every_exclusion():
    vocab = [" bank", " aardvark", " the", ",", " goose", "ish", " zebu"]
    senses = {"bank": 3, "aardvark": 1, "goose": 2, "zebu": 2}
    group, words, why = classify_tokens(torch.tensor([0, 1, 2, 3, 4, 5, 6, 0]), lambda t: vocab[t[0]], senses, 3)
    assert group.tolist() == [POLYSEMOUS, MONOSEMOUS] + [EXCLUDED] * 5 + [POLYSEMOUS]
    assert words[:3] == ["bank", "aardvark", "the"] and words[4:6] == [None, None]  # " goose"+"ish": no word
    assert why == {"not_a_whole_word": 3, "not_in_wordnet": 1, "2_to_2_senses": 1}


def test_permutation_test_finds_a_planted_difference_and_not_an_absent_one():
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(400) % 2 == 0
    planted = torch.randn(400, generator=gen) + 0.5 * labels
    assert permutation_pvalue(planted, labels, 2000, torch.Generator().manual_seed(1)) < 0.01
    same = torch.arange(400) // 2 % 5 * 1.0  # both groups hold the same values
    assert permutation_pvalue(same, labels, 2000, torch.Generator().manual_seed(1)) == 1.0
    noise = torch.randn(400, generator=gen)
    assert permutation_pvalue(noise, labels, 2000, torch.Generator().manual_seed(1)) > 0.05
    assert permutation_pvalue(noise, torch.ones(400, dtype=torch.bool), 10, gen) == 1.0  # one group only


def test_frequency_strata_remove_a_confound_and_keep_a_real_effect():
    gen = torch.Generator().manual_seed(0)
    strata = torch.arange(200) % 2  # e.g. rare and frequent words
    labels = torch.rand(200, generator=gen) < torch.where(strata == 1, 0.8, 0.2)  # frequent: mostly polysemous
    confounded = strata + 0.1 * torch.randn(200, generator=gen)  # diversity follows frequency only
    assert permutation_pvalue(confounded, labels, 1000, torch.Generator().manual_seed(1)) < 0.01
    assert permutation_pvalue(confounded, labels, 1000, torch.Generator().manual_seed(1), strata=strata) > 0.05
    real = confounded + 0.3 * labels
    assert permutation_pvalue(real, labels, 1000, torch.Generator().manual_seed(1), strata=strata) < 0.01
    assert frequency_strata(torch.tensor([1.0, 2, 3, 4, 7, 8])).tolist() == [0, 1, 1, 2, 2, 3]


def _records(div_per_layer, heads=4, top_k=2, experts=8):
    recs = []
    for d in div_per_layer:
        r = RoutingRecord(experts, heads * top_k, torch.zeros(experts, dtype=torch.float64), top_k, tokens=len(d))
        r.diversity = [torch.tensor(d[: len(d) // 2]), torch.tensor(d[len(d) // 2:])]  # two batches
        recs.append(r)
    return recs


VOCAB = [" bank", " aardvark", ",", " run", " zebu"]
SENSES = {"bank": 10, "run": 40, "aardvark": 1, "zebu": 1}


def test_planted_polysemy_effect_is_found_beside_random_routing():
    torch.manual_seed(0)
    ids = torch.randint(0, len(VOCAB), (600,))
    poly = (ids == 0) | (ids == 3)
    mono = (ids == 1) | (ids == 4)
    layer0 = torch.where(poly, 6, torch.where(mono, 4, 1)) + torch.randint(0, 2, (600,))  # planted: +2
    layer1 = 3 + torch.randint(0, 3, (600,))  # no effect
    s = polysemy_statistics(_records([layer0.tolist(), layer1.tolist()]), [ids[:300], ids[300:]],
                            lambda t: VOCAB[t[0]], SENSES, min_senses=3, n_perm=500)
    l0, l1 = s["layers"]
    assert l0["difference"] == pytest.approx(2.0, abs=0.15) and l0["p_value"] < 0.01
    assert l0["polysemous_mean"] == pytest.approx(float(layer0[poly].double().mean()))
    assert l0["p_value_types"] == pytest.approx(1 / 3, abs=0.06)  # 2 vs 2 word types: the least p is 2/6
    assert 0 < l0["p_value_types_frequency_strata"] <= 1
    assert l1["p_value"] > 0.01 and abs(l1["difference"]) < 0.3
    for lay in (l0, l1):  # random routing: h=4 x top-2 over 8 experts, the same for both groups
        assert lay["expected_random"] == pytest.approx(8 * (1 - 0.75 ** 4))
        assert lay["random_polysemous_mean"] == pytest.approx(lay["expected_random"], abs=0.2)
        assert lay["random_monosemous_mean"] == pytest.approx(lay["expected_random"], abs=0.2)
    assert s["tokens"]["polysemous"] == int(poly.sum())
    assert s["tokens"]["excluded"]["not_a_whole_word"] == int((ids == 2).sum())  # the commas
    assert s["tokens"]["excluded"]["not_in_wordnet"] == 0 and s["word_types"] == {"polysemous": 2, "monosemous": 2}
    assert s["mean_over_layers"]["difference"] == pytest.approx(1.0, abs=0.15)
    assert [w for w, _, _ in s["examples"]["polysemous"]] and "note" not in s
    json.dumps(s, allow_nan=False)  # strict JSON


def test_h1_models_say_the_comparison_is_trivial(tmp_path):
    ids = torch.tensor([0, 1, 3, 4] * 10)
    s = polysemy_report(_records([[2] * 40], heads=1, top_k=2, experts=8), [ids], lambda t: VOCAB[t[0]],
                        tmp_path / "analysis", senses=SENSES, n_perm=50)
    assert s["note"] == TRIVIAL_NOTE and s["layers"][0]["difference"] == 0.0 and s["layers"][0]["p_value"] == 1.0
    assert s["layers"][0]["random_polysemous_mean"] == 2.0
    assert (tmp_path / "analysis" / "polysemy.png").stat().st_size > 0
    assert json.loads((tmp_path / "analysis" / "polysemy.json").read_text())["heads"] == 1


def test_analyze_polysemy_cli_on_a_tiny_run(tmp_path, monkeypatch, capsys):
    from helpers import tiny_run

    from mhmoe.cli import main
    from mhmoe.train.loop import train

    torch.set_num_threads(1)
    rng = torch.Generator().manual_seed(0)
    (tmp_path / "corpus").mkdir()
    for i in range(12):  # byte tokens: only one-letter words are whole-word tokens
        words = [("a", "i", "o", "the")[int(k)] for k in torch.randint(0, 4, (250,), generator=rng)]
        (tmp_path / "corpus" / f"doc{i:02d}.txt").write_text(" ".join(words) + "\n")
    train(tiny_run(tmp_path, max_steps=2), tmp_path / "run", progress=False)
    (tmp_path / "wn").mkdir()
    monkeypatch.setattr(wordnet, "WORDNET_DIR", tmp_path / "wn")
    assert main(["analyze", "--checkpoint", str(tmp_path / "run"), "--batches", "1", "--polysemy"]) == 2
    assert "apt-get install wordnet-base" in capsys.readouterr().err  # fails before routing anything
    fake_wordnet(tmp_path / "wn")
    (tmp_path / "wn" / "index.adj").write_text(HEADER + "a a 3 0 3 0 1 2 3  \ni a 1 0 1 0 1  \n")
    assert main(["analyze", "--checkpoint", str(tmp_path / "run"), "--batches", "1", "--polysemy",
                 "--min-senses", "2", "--permutations", "50"]) == 0
    out = capsys.readouterr().out
    assert "polysemous (WordNet senses >= 2)" in out and "p words within frequency strata" in out
    saved = json.loads((tmp_path / "run" / "analysis" / "polysemy.json").read_text())
    assert saved["min_senses"] == 2 and saved["permutations"] == 50 and len(saved["layers"]) == 1
    assert saved["tokens"]["polysemous"] > 0 and saved["tokens"]["monosemous"] > 0  # "a" and "i"
    assert saved["tokens"]["excluded"]["not_in_wordnet"] > 0  # "o"
    assert (tmp_path / "run" / "analysis" / "polysemy.png").is_file()
    assert main(["analyze", "--checkpoint", str(tmp_path / "run"), "--polysemy", "--min-senses", "1"]) == 2
    assert main(["analyze", "--suite", str(tmp_path), "--polysemy"]) == 2
    assert "--polysemy" in capsys.readouterr().err
