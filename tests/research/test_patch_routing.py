"""ICML Fig. 8 for an encoder run (mhmoe.research.patch_routing): the patch maps are the routing the model
does (recomputed here from the router's own decisions), one map per checkpoint of the run, the sub-token
expert picture has each patch cut into its H sub-tokens, and `mhmoe analyze` draws it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mm_helpers import XMOE_MH, mm_run

from mhmoe.loading.checkpoint import load_latest
from mhmoe.research.patch_routing import (
    ImageSequences,
    _subgrid,
    analyze_encoder_checkpoint,
    expert_canvas,
    image_inputs,
    spread,
    subtoken_experts,
)
from mhmoe.train.loop import train
from mhmoe.train.objectives import build_objective


def test_checkpoints_shown_spread_over_the_run():
    assert spread([1, 2], 3) == [1, 2]
    assert spread([1, 2, 3, 4, 5], 3) == [1, 3, 5]
    assert spread([10, 20, 30, 40], 3) == [10, 30, 40]
    assert spread([10, 20, 30, 40], 1) == [40]


def test_subtoken_layout():
    assert [_subgrid(h) for h in (1, 2, 3, 4, 6, 8)] == [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (2, 4)]
    experts = np.arange(2 * 3 * 4).reshape(2, 3, 4)  # patch (r, c) has sub-tokens 12r + 4c + 0..3
    canvas = expert_canvas(experts)
    assert canvas.shape == (4, 6)
    assert canvas[:2, :2].tolist() == [[0, 1], [2, 3]]  # patch (0, 0): sub-tokens row-major in a 2x2 cell
    assert canvas[2:, 4:].tolist() == [[20, 21], [22, 23]]  # patch (1, 2)


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enc")
    run = mm_run(tmp, XMOE_MH, max_steps=4, ckpt_every=2, keep_last=3)
    train(run, tmp / "r", progress=False)
    return tmp / "r"


def test_patch_maps_are_the_models_routing(encoder_run, tmp_path):
    summary = analyze_encoder_checkpoint(encoder_run, tmp_path / "a", batches=2, n_images=3)
    fig = json.loads((tmp_path / "a" / "fig8.json").read_text())
    assert (tmp_path / "a" / "fig8.png").stat().st_size > 10_000
    assert sorted(fig["diversity"]) == ["2", "4"]  # every checkpoint of the run, oldest first
    ck = load_latest(encoder_run)
    data = build_objective(ck.run, tokenizer=ck.tokenizer).data
    images = fig["images"]
    assert images == [int(i) for i in data.split_images["val"][:3]]
    # recompute the newest map from the router's decisions: distinct valid experts over a patch's H*K slots
    x = image_inputs(data, images)
    with torch.no_grad():
        route = ImageSequences(ck.model.eval(), data.grid)(x, return_routing=True).layer_outputs[0].route
    n, t = x.shape
    experts = route.experts.view(n, t, -1)
    valid = route.valid.view(n, t, -1)
    want = np.zeros((n, *data.grid))
    for i in range(n):
        for p in range(t - 2):
            want[i, p // data.grid[1], p % data.grid[1]] = len(set(experts[i, p + 1][valid[i, p + 1]].tolist()))
    np.testing.assert_allclose(np.array(fig["diversity"]["4"]), want, atol=1e-4)
    assert want.min() >= 1 and want.max() <= summary["max_possible_diversity"] == 4
    assert not np.allclose(np.array(fig["diversity"]["2"]), want)  # an earlier checkpoint routes otherwise
    # the expert picture: each sub-token's highest-weight expert
    top = route.experts.gather(-1, route.weights.argmax(-1, keepdim=True)).view(n, t, -1)[:, 1:-1]
    assert np.array(fig["experts"]).reshape(n, -1, 2).tolist() == top.tolist()
    assert subtoken_experts(ck.model, data, images, "cpu").shape == (3, *data.grid, 2)
    assert summary["tokens_analysed"] == 2 * 6 * t and 0 < summary["mean_assign_diversity"] <= 4


def test_cli_analyze_draws_fig8_for_an_encoder_run(encoder_run, tmp_path, capsys):
    from mhmoe.cli import main

    ck_dir = load_latest(encoder_run).path  # a single checkpoint: one diversity column
    assert main(["analyze", "--checkpoint", str(ck_dir), "--out", str(tmp_path / "a"), "--batches", "1",
                 "--images", "2"]) == 0
    assert "fig8.png" in capsys.readouterr().err
    fig = json.loads((tmp_path / "a" / "fig8.json").read_text())
    assert list(fig["diversity"]) == ["4"] and len(fig["images"]) == 2
    assert main(["analyze", "--checkpoint", str(encoder_run), "--data", "kjv"]) == 2
    assert "--data" in capsys.readouterr().err
