"""Distributed training on CPU with gloo, 2 processes (torch.multiprocessing.spawn): expert-parallel
layers equal the single-process layer (outputs and gradients), DDP / FSDP2 training reproduces the
single-process loss curve on the same global batch (with activation checkpointing, and in float16 with its loss
scale, too), and DCP checkpoints reshard from 2 ranks to 1.

Each test spawns its processes once and runs several cases inside them (process start-up dominates).
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.layers import build_ffn_layer

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, world: int = WORLD) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; a failure in any of them fails the test."""
    torch.multiprocessing.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)


# ---- (a) expert parallelism == the single-process layer --------------------------------------------------
# init_std 0.3: outputs of order 1, so that the absolute tolerances below are meaningful
EP_CASES = {
    "smoe": (16, MoEConfig(n_experts=4, top_k=2, d_expert=8, z_loss_weight=1e-2, entropy_loss_weight=1e-2,
                           impl="sorted", init_std=0.3)),
    "mhmoe": (24, MoEConfig(n_experts=6, top_k=3, d_expert=8, heads=3, head_layer=True, merge_layer=True,
                            balance_loss_weight=0.1, entropy_loss_weight=1e-2, entropy_mode="batch", init_std=0.3)),
    # experts 0 and 1 are never chosen: rank 0 receives no rows at all (empty splits both ways)
    "idle-rank": (16, MoEConfig(n_experts=4, top_k=1, d_expert=8, aux_free_bias=True, n_shared=1, d_shared=8,
                                init_std=0.3)),
    "padding-mask": (24, MoEConfig(n_experts=4, top_k=2, d_expert=8, heads=2, head_layer=True, merge_layer=True,
                                   z_loss_weight=1e-2, init_std=0.3)),
}


def _ep_worker(rank: int, world: int, names: list[str]) -> None:
    from mhmoe.parallel.expert_parallel import apply_expert_parallel

    group = dist.group.WORLD
    for name in names:
        d, cfg = EP_CASES[name]
        torch.manual_seed(0)
        ref = build_ffn_layer(d, cfg)
        if name == "idle-rank":
            ref.router.selection_bias[:2] = -1e9
        B, T = 3, 5  # per rank
        x = torch.randn(world * B, T, d)
        g = torch.randn(world * B, T, d)
        mask = None
        if name == "padding-mask":
            mask = torch.ones(world * B, T, dtype=torch.bool)
            mask[1, 3:] = False
            mask[B + 2, 1:] = False  # the ranks have different numbers of real tokens
        holder = torch.nn.ModuleDict({"ffn": copy.deepcopy(ref)})
        layers = apply_expert_parallel(holder, group, group)
        ep = holder["ffn"]
        assert len(layers) == 1 and layers[0].experts.n_experts == cfg.n_experts // world
        # single process on the global batch
        xr = x.clone().requires_grad_()
        out = ref(xr, mask)
        ((out.out * g).sum() + out.aux_loss).backward()
        # this rank's share; every rank adds aux/W so that the sum over ranks is the reference loss
        sl = slice(rank * B, (rank + 1) * B)
        xe = x[sl].clone().requires_grad_()
        res = ep(xe, None if mask is None else mask[sl])
        ((res.out * g[sl]).sum() + res.aux_loss / world).backward()
        torch.testing.assert_close(res.out, out.out[sl], atol=1e-5, rtol=1e-4, msg=f"{name}: output")
        torch.testing.assert_close(res.aux_loss, out.aux_loss, atol=1e-6, rtol=1e-5, msg=f"{name}: aux loss")
        torch.testing.assert_close(xe.grad, xr.grad[sl], atol=1e-5, rtol=1e-4, msg=f"{name}: input grad")
        assert torch.equal(res.stats.counts, out.stats.counts), name
        assert res.stats.tokens == out.stats.tokens and res.stats.dropped == out.stats.dropped
        for k, v in out.stats.losses.items():  # abs: a few fp32 ulps of log E (batch entropy = log E - H)
            assert float(res.stats.losses[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), (name, k)
        ref_params = dict(ref.named_parameters())
        E_l = layers[0].experts.n_experts
        n_expert = 0
        for pname, p in ep.named_parameters():
            want = ref_params[pname].grad
            if pname.startswith(("experts.", "moe.experts.")):
                # local experts: rows [rank*E_l, (rank+1)*E_l) of the full gradient, no reduction
                got = torch.zeros_like(p) if p.grad is None else p.grad  # an idle rank's experts get no gradient
                torch.testing.assert_close(got, want[rank * E_l:(rank + 1) * E_l], atol=1e-5, rtol=1e-4,
                                           msg=f"{name}: {pname}")
                n_expert += 1
            else:  # replicated (router, head/merge, shared experts): the sum over ranks
                grad = p.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=f"{name}: {pname}")
        assert n_expert >= 2 and any("router" in n for n in ref_params), name
        if name == "idle-rank":
            assert int(out.stats.counts[:2].sum()) == 0
            if rank == 0:
                assert ep.experts.w1.grad is None
        if name == "smoe":  # the comparison is not vacuous: a 1% change of one local expert is caught
            with torch.no_grad():
                ep.experts.w2.mul_(1.01)
            with pytest.raises(AssertionError):
                torch.testing.assert_close(ep(x[sl]).out, out.out[sl], atol=1e-5, rtol=1e-4)


def test_expert_parallel_matches_single_process():
    spawn(_ep_worker, list(EP_CASES))


# ---- (b) DDP / FSDP2 (+ EP) training == one process on the union batch ------------------------------------
SMOE4 = MoEConfig(n_experts=4, top_k=2, d_expert=32, z_loss_weight=1e-3)
TRAIN_CASES = {  # name -> (moe, train overrides); MHMOE is test_train's MH-MoE (6 experts, 3 heads)
    "ddp": ("MHMOE", dict(parallel="ddp")),
    "fsdp": ("MHMOE", dict(parallel="fsdp", activation_checkpointing="blocks")),
    "ddp-ep2-accum": (SMOE4, dict(parallel="ddp", ep=2, grad_accum=2, ckpt_every=3)),
    # the MoE layers recomputed in the backward: their all-to-alls run again, on every rank alike
    "fsdp-ep2": (MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True),
                 dict(parallel="fsdp", ep=2, grad_accum=2, activation_checkpointing="moe")),
    # float16 with loss scaling: one scale on every rank, driven by the all-reduced gradient norm
    "ddp-ep2-fp16": (SMOE4, dict(parallel="ddp", ep=2, dtype="float16")),
}

SLOW_CASES = {  # 4 processes, dp x ep = 2 x 2: 4 experts per rank, FSDP2 shards them over the 2 dp ranks
    "mh-8": (MoEConfig(n_experts=8, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True),
             dict(ep=2, grad_accum=2)),
}


def _case_run(root: Path, name: str, **override):
    from helpers import MHMOE, tiny_run

    moe, extra = {**TRAIN_CASES, **SLOW_CASES}[name]
    return tiny_run(root, MHMOE if moe == "MHMOE" else moe, **{**extra, **override})


def _train_worker(rank: int, world: int, root: str) -> None:
    from mhmoe.parallel import train_parallel as train

    for name in TRAIN_CASES:
        train(_case_run(Path(root), name), Path(root) / name, progress=False)
    # a single-process checkpoint (step 3) resumed by 2 ranks with EP: converted to DCP, resharded
    train(_case_run(Path(root), "ddp-ep2-accum", max_steps=5), Path(root) / "single", resume=True, progress=False)


def _union_sampler(monkeypatch, world: int = WORLD) -> None:
    """Make the single-process sampler return the union of the ``world`` ranks' micro-batches, in rank order."""
    from mhmoe.data import BatchSampler

    original = BatchSampler.get_batch

    def union(self, step, micro=0):
        parts = [original(BatchSampler(self.tokens, batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed,
                                       rank=r, world_size=world), step, micro) for r in range(world)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    monkeypatch.setattr(BatchSampler, "get_batch", union)


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """The three 2-process training runs (one spawn)."""
    from helpers import write_corpus

    from mhmoe.train.loop import train

    root = tmp_path_factory.mktemp("dist")
    write_corpus(root / "corpus")
    train(_case_run(root, "ddp-ep2-accum", parallel="none", ep=1, max_steps=3), root / "single", progress=False)
    import shutil

    shutil.copytree(root / "single", root / "single-copy")
    spawn(_train_worker, str(root))
    return root


def _records(d: Path) -> list[dict]:
    return [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_data_parallel_loss_curve_matches_single_process(dist_runs, tmp_path, monkeypatch, name):
    from mhmoe.train.loop import train

    _union_sampler(monkeypatch)
    ref_dir = tmp_path / "ref"
    train(_case_run(dist_runs, name, parallel="none", ep=1), ref_dir, progress=False)
    got, want = _records(dist_runs / name), _records(ref_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    scale = ["loss_scale", "scale_skips"] if TRAIN_CASES[name][1].get("dtype") == "float16" else []
    for key in ("loss", "aux_loss", "grad_norm", "load_imbalance", "balance_loss", *scale):
        a, b = [r[key] for r in got], [r[key] for r in want]
        assert a == pytest.approx(b, rel=2e-4, abs=1e-6), (name, key)
    assert got[0]["tokens"] == WORLD * want[0]["tokens"]  # all ranks counted (the reference config says B rows)
    summary = json.loads((dist_runs / name / "results.json").read_text())
    assert summary["world_size"] == WORLD and summary["parallel"] == TRAIN_CASES[name][1]["parallel"]
    assert summary["params"] == json.loads((ref_dir / "results.json").read_text())["params"]
    assert summary["eval"]["corpus"]["loss"] == pytest.approx(
        json.loads((ref_dir / "results.json").read_text())["eval"]["corpus"]["loss"], rel=1e-4)


def test_union_reference_is_not_trivially_equal(dist_runs, tmp_path):
    """Without the union sampler (one process, its own batches) the curve differs: the comparison can fail."""
    from mhmoe.train.loop import train

    train(_case_run(dist_runs, "ddp", parallel="none", batch_size=8), tmp_path / "plain", progress=False)
    a, b = [r["loss"] for r in _records(dist_runs / "ddp")], [r["loss"] for r in _records(tmp_path / "plain")]
    assert a != pytest.approx(b, rel=2e-4)


def test_float16_dcp_checkpoint_carries_the_loss_scale(dist_runs):
    """The 2-rank float16 run's sharded checkpoint holds its loss scale, and a resume accepts it."""
    from mhmoe.train.resume import load_latest_for_resume

    ck = load_latest_for_resume(dist_runs / "ddp-ep2-fp16")
    assert ck.format == "dcp" and ck.step == 6
    scale = ck.trainer_state["loss_scale"]["scale"]
    assert float(scale) == _records(dist_runs / "ddp-ep2-fp16")[-1]["loss_scale"]


# ---- (c) DCP checkpoint saved by 2 ranks (EP) loads in 1 process, converts, and training continues ----------
def test_dcp_checkpoint_reshards_to_one_process_and_continues(dist_runs, tmp_path, monkeypatch):
    from mhmoe.checkpoint.format import list_checkpoints
    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.train.convert import dcp_to_safetensors, safetensors_to_dcp
    from mhmoe.train.loop import train

    src = dist_runs / "ddp-ep2-accum"
    assert [p.name for p in list_checkpoints(src)] == ["step_00000003", "step_00000006"]
    meta = json.loads((list_checkpoints(src)[0] / "meta.json").read_text())
    assert meta["format"] == "dcp" and meta["world_size"] == 2 and meta["ep"] == 2
    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(list_checkpoints(src)[0], run_dir / "checkpoints" / "step_00000003")
    for f in ("metrics.jsonl", "eval.jsonl"):
        shutil.copy(src / f, run_dir / f)
    # one process, the same global batches: steps 4..6 continue the 2-rank run's curve
    _union_sampler(monkeypatch)
    train(_case_run(dist_runs, "ddp-ep2-accum", parallel="none", ep=1), run_dir, resume=True, progress=False)
    got, want = _records(run_dir), _records(src)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-4)
    # the full expert stacks were reassembled from the two ranks' halves
    ck = load_latest(run_dir)
    assert ck.model.blocks[1].ffn.experts.w1.shape[0] == 4
    # DCP (world 2) -> single-file safetensors -> DCP (world 1): same weights, loadable everywhere
    dcp6 = list_checkpoints(src)[-1]
    single = dcp_to_safetensors(dcp6, tmp_path / "st")
    assert (single / "model.safetensors").is_file() and not (single / "dcp").exists()
    a, b = load_latest(dcp6).model.state_dict(), load_latest(single).model.state_dict()
    back = load_latest(safetensors_to_dcp(single, tmp_path / "dcp1")).model.state_dict()
    assert a.keys() == b.keys() == back.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], back[k]), k
    # FSDP2 + EP shards (ep outer, dp inner) reassemble too: one process evaluates as the 2 ranks did
    from mhmoe.data import prepare_data
    from mhmoe.train.evaluate import evaluate

    ck = load_latest(dist_runs / "fsdp-ep2")
    cfg = ck.run.train
    assert ck.model.blocks[1].ffn.moe.experts.w1.shape[0] == 6
    data = prepare_data(ck.run.data, seq_len=cfg.seq_len, tokenizer=ck.tokenizer, progress=False)
    res = evaluate(ck.model, data.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=cfg.eval_batches)
    want = json.loads((dist_runs / "fsdp-ep2" / "results.json").read_text())["eval"]["corpus"]["loss"]
    assert res["corpus"]["loss"] == pytest.approx(want, rel=1e-5)


def test_torchrun_cli_resumes_an_ep_checkpoint_with_fsdp(dist_runs, tmp_path):
    """``torchrun -m mhmoe train --resume --parallel fsdp``: the DDP + EP=2 run's DCP checkpoint is
    resharded into FSDP2 shards and training continues (the real launcher, the real CLI)."""
    import shutil
    import subprocess
    import sys

    from mhmoe.checkpoint.format import list_checkpoints

    run_dir = tmp_path / "run"
    shutil.copytree(dist_runs / "ddp-ep2-accum", run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mhmoe",
           "train", "--config", str(run_dir / "config.yaml"), "--out", str(run_dir), "--resume", "--max-steps", "8",
           "--parallel", "fsdp", "--ep", "1", "--no-progress", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 8  # one summary: rank 0 reports
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert recs[7]["loss"] < recs[0]["loss"]
    meta = json.loads((list_checkpoints(run_dir)[-1] / "meta.json").read_text())
    assert meta["step"] == 8 and meta["format"] == "dcp" and meta["ep"] == 1
    summary = json.loads((run_dir / "results.json").read_text())
    assert summary["parallel"] == "fsdp" and summary["world_size"] == 2


# ---- bad settings: one-line errors naming the field (no processes needed) -----------------------------------
def test_bad_parallel_settings_are_one_line_errors(monkeypatch, tmp_path, capsys):
    from mhmoe.cli import main
    from mhmoe.config.model import ModelConfig
    from mhmoe.config.train import TrainConfig
    from mhmoe.errors import ConfigError
    from mhmoe.model.lm import LM
    from mhmoe.parallel.data_parallel import check_parallel
    from mhmoe.parallel.launch import parallel_mode

    with pytest.raises(ConfigError, match=r"train.parallel='tp': allowed auto \| none \| ddp \| fsdp"):
        TrainConfig(parallel="tp")
    with pytest.raises(ConfigError, match="train.ep"):
        TrainConfig(ep=0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel_mode(TrainConfig()) == "none"
    with pytest.raises(ConfigError, match="train.ep=2: allowed 1 without torchrun"):
        parallel_mode(TrainConfig(ep=2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parallel_mode(TrainConfig()) == "ddp"
    with pytest.raises(ConfigError, match="train.parallel='none'"):
        parallel_mode(TrainConfig(parallel="none"))
    small = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=16, max_seq_len=16)
    dense = LM(ModelConfig(**small, moe=MoEConfig(kind="dense", d_expert=16)))
    with pytest.raises(ConfigError, match="no MoE layers"):
        check_parallel(dense, "ddp", 2, 2)
    moe = LM(ModelConfig(**small, moe=MoEConfig(n_experts=6, d_expert=8)))
    with pytest.raises(ConfigError, match="n_experts=6"):
        check_parallel(moe, "ddp", 4, 4)
    with pytest.raises(ConfigError, match="divide evenly"):
        check_parallel(moe, "fsdp", 2, 8)  # 3 experts per rank over 4 dp ranks
    check_parallel(moe, "fsdp", 3, 6)  # 2 experts per rank over 2 dp ranks
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["train", "--preset", "tiny-smoe", "--out", str(tmp_path / "r"), "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.ep=2" in err[0]


def test_single_process_checkpoint_resumes_under_two_ranks(dist_runs, monkeypatch):
    """1 -> 2 ranks: the 2-rank DDP + EP resume of a single-file checkpoint continues exactly like one
    process resuming it on the union batches."""
    from mhmoe.checkpoint.format import list_checkpoints
    from mhmoe.train.loop import train

    got = _records(dist_runs / "single")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert json.loads((list_checkpoints(dist_runs / "single")[-1] / "meta.json").read_text())["format"] == "dcp"
    assert not (dist_runs / "single" / ".dcp-resume").exists()  # the converted copy was removed
    _union_sampler(monkeypatch)
    ref = dist_runs / "single-copy"
    train(_case_run(dist_runs, "ddp-ep2-accum", parallel="none", ep=1, max_steps=5), ref, resume=True, progress=False)
    want = _records(ref)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=2e-4)


# ---- dp x ep = 2 x 2 (4 processes): expert gradients reduced over the dp group -------------------------------
def _dp_ep_worker(rank: int, world: int, root: str) -> None:
    from mhmoe.parallel import train_parallel as train  # the torchrun entry point (train.train is one process)

    for mode in ("ddp", "fsdp"):
        train(_case_run(Path(root), "mh-8", parallel=mode), Path(root) / f"{mode}-2x2", progress=False)


@pytest.mark.slow
def test_dp2_x_ep2_matches_single_process(tmp_path, monkeypatch):
    """4 ranks on the ("dp", "ep") = (2, 2) mesh: 4 experts per rank, replicated (DDP) or sharded (FSDP2)
    over the 2 dp ranks; the loss curve equals one process on the union of the 4 ranks' batches."""
    from helpers import write_corpus

    from mhmoe.train.loop import train

    write_corpus(tmp_path / "corpus")
    spawn(_dp_ep_worker, str(tmp_path), world=4)
    _union_sampler(monkeypatch, world=4)
    train(_case_run(tmp_path, "mh-8", parallel="none", ep=1), tmp_path / "ref", progress=False)
    want = _records(tmp_path / "ref")
    for mode in ("ddp", "fsdp"):
        got = _records(tmp_path / f"{mode}-2x2")
        for key in ("loss", "aux_loss", "grad_norm"):
            assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=2e-4), (mode, key)
