"""transformers integration: save/load round-trip, Auto* registration, generate() vs our sampler,
padded batches, tokenizer export and `mhmoe export --hf` (skipped without the ``hf`` extra)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from ecosystem_helpers import KINDS, tiny_checkpoint, trained_lm  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from mhmoe.cli import main  # noqa: E402
from mhmoe.data import ByteTokenizer, Tokenizer, get_pretrained_tokenizer, train_bpe  # noqa: E402
from mhmoe.errors import DataError  # noqa: E402
from mhmoe.integrations.hf import MHMoEConfig, MHMoEForCausalLM, MHMoESamplingFilter, to_hf_tokenizer  # noqa: E402
from mhmoe.integrations.hf.modeling_mhmoe import output_cache  # noqa: E402
from mhmoe.model.generate import generate  # noqa: E402
from mhmoe.model.lm import KVCache  # noqa: E402
from mhmoe.moe.dispatch import native  # noqa: E402

EOS = 256


def _ids(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 257, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip_gives_identical_logits(kind, tmp_path):
    lm = trained_lm(kind)
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mhmoe"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # tied embeddings stored once
        keys = set(f.keys())
    assert "model.embed.weight" in keys and "model.lm_head.weight" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MHMoEForCausalLM and not loaded.training
    assert loaded.model.lm_head.weight is loaded.model.embed.weight
    assert loaded.config.model_config() == lm.cfg
    x = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, lm(x).logits)
        assert torch.equal(model(x).logits, lm(x).logits)


def test_untied_embeddings_round_trip(tmp_path):
    lm = trained_lm("smoe", tie_embeddings=False)
    MHMoEForCausalLM.from_lm(lm).save_pretrained(tmp_path)
    loaded = MHMoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.lm_head.weight is not loaded.model.embed.weight
    assert torch.equal(loaded.model.lm_head.weight, lm.lm_head.weight)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, lm(_ids()).logits)


def test_auto_classes_are_registered():
    cfg = AutoConfig.for_model("mhmoe", mhmoe=trained_lm("dense", steps=0).cfg.to_dict(), eos_token_id=EOS)
    assert isinstance(cfg, MHMoEConfig) and cfg.vocab_size == 257 and cfg.tie_word_embeddings
    assert cfg.pad_token_id == cfg.bos_token_id == EOS
    assert type(AutoModelForCausalLM.from_config(cfg)) is MHMoEForCausalLM


def test_bad_nested_config_is_a_one_line_config_error():
    bad = trained_lm("dense", steps=0).cfg.to_dict()
    bad["n_heads"] = 5
    with pytest.raises(ValueError, match="n_heads"):
        MHMoEConfig(mhmoe=bad)


def test_labels_loss_is_shifted_cross_entropy_plus_aux():
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm)
    x = _ids(2, 10)
    with torch.no_grad():
        out = model(x, labels=x)
        ref = lm(x[:, :-1], x[:, 1:])
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    torch.testing.assert_close(out.loss, ref.total_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cache_decoding_matches_full_forward(name):
    """The KV cache is read under the name of every transformers version (5.24+: cache=)."""
    model = MHMoEForCausalLM.from_lm(trained_lm("mhmoe"))
    x = _ids(2, 10)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        first = model(x[:, :6], use_cache=True)
        cache = output_cache(first)
        assert cache is not None and cache.get_seq_length() == 6
        rest = [model(x[:, t:t + 1], **{name: cache}, use_cache=True).logits for t in range(6, 10)]
        assert cache.get_seq_length() == 10
    torch.testing.assert_close(torch.cat([first.logits, *rest], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["mhmoe", "bitnet"])
def test_greedy_generate_matches_our_generator(kind):
    lm = trained_lm(kind)
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    prompt = _ids(2, 5)
    ours = generate(lm, prompt, 12, temperature=0)
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 1.0), (1.3, 0, 0.9), (0.7, 40, 0.8)])
def test_sampling_generate_matches_our_generator_for_the_same_seed(temperature, top_k, top_p):
    """transformers draws with the global generator, ours with an explicit one: seeding both with
    the same seed gives the same multinomial draws on the same probabilities. top-p runs our whole
    step through MHMoESamplingFilter (transformers' TopPLogitsWarper cuts at ties differently)."""
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    prompt = _ids(2, 4)
    for seed in (0, 7):
        ours = generate(lm, prompt, 16, temperature, top_k, top_p, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        if top_p < 1.0:
            ours_step = MHMoESamplingFilter(temperature, top_k, top_p)
            theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    logits_processor=[ours_step], eos_token_id=None)
        else:
            theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=temperature, top_k=top_k,
                                    top_p=1.0, eos_token_id=None)
        assert torch.equal(theirs, ours), seed
    # transformers' own top-p warper agrees with ours away from exact probability ties
    torch.manual_seed(3)
    theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=1.3, top_k=0, top_p=0.9,
                            eos_token_id=None)
    assert torch.equal(theirs, generate(lm, prompt, 16, 1.3, 0, 0.9, generator=torch.Generator().manual_seed(3)))


def test_left_padded_batch_generates_like_single_rows():
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    long, short = _ids(1, 7, seed=2)[0], _ids(1, 4, seed=3)[0]
    batch = torch.stack([long, torch.cat([torch.full((3,), EOS), short])])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out[0], generate(lm, long[None], 8, temperature=0)[0])
    assert torch.equal(out[1, 3:], generate(lm, short[None], 8, temperature=0)[0])
    with torch.no_grad():  # the padded row's logits equal the unpadded row's
        torch.testing.assert_close(model(batch, attention_mask=mask).logits[1, 3:], lm(short[None]).logits[0],
                                   rtol=1e-4, atol=1e-5)


def test_our_kv_cache_still_works_directly():
    lm = trained_lm("smoe")
    x = _ids(1, 6)
    cache = KVCache(lm.cfg.n_layers)
    with torch.no_grad():
        a = lm(x[:, :4], cache=cache).logits
        b = lm(x[:, 4:], cache=cache).logits
        torch.testing.assert_close(torch.cat([a, b], 1), lm(x).logits, rtol=1e-5, atol=1e-5)
    assert cache.length == 6 and cache.layer_length(1) == 6


TEXTS = ["In the beginning God created the heaven and the earth.", "naïve café 日本 🙂\n\n  x  y\t", "don't 123456"]


@pytest.mark.parametrize("which", ["byte", "bpe", "gpt2", "cl100k_base"])
def test_tokenizer_export_keeps_ids(which, tmp_path):
    if which == "bpe":
        tok: Tokenizer = train_bpe([" ".join(TEXTS) * 20, "the earth and the heaven"], 300)
    elif which == "byte":
        tok = ByteTokenizer()
    else:
        try:
            tok = get_pretrained_tokenizer(which)
        except DataError as exc:
            pytest.skip(str(exc))
    to_hf_tokenizer(tok, model_max_length=64).save_pretrained(tmp_path)
    fast = AutoTokenizer.from_pretrained(tmp_path)
    assert fast.eos_token_id == fast.pad_token_id == tok.eos_id and fast.model_max_length == 64
    for text in TEXTS:
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text) and fast.decode(ids) == tok.decode(ids)


def test_export_hf_cli_converts_a_checkpoint(tmp_path, capsys):
    ck = tiny_checkpoint(tmp_path / "run", "mhmoe")
    out = tmp_path / "hf"
    assert main(["export", "--hf", str(tmp_path / "run"), str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["max_abs_logit_diff"] == 0.0 and rep["step"] == 3
    assert {"config.json", "model.safetensors", "tokenizer.json", "mhmoe_tokenizer/tokenizer_meta.json"} <= set(
        rep["files"])
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    from mhmoe.loading.checkpoint import load_checkpoint

    lm = load_checkpoint(ck).model.eval()
    x = torch.tensor([tok("In the beginning")["input_ids"]])
    assert x[0].tolist() == list(b"In the beginning")
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x).logits)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_export_hf_refuses_a_non_empty_out_and_bad_checkpoints(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "run", "dense")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--hf", str(tmp_path / "run"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", "--hf", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "o2").exists()
    with pytest.raises(SystemExit) as exc:  # argparse: one format only
        main(["export", "--hf", "--bitnet", str(tmp_path / "run"), str(tmp_path / "o3")])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty directory is fine
    assert main(["export", "--hf", str(tmp_path / "run"), str(empty)]) == 0


# a fresh interpreter in which mhmoe cannot be imported: the exported directory must carry its own code
WITHOUT_MHMOE = r"""
import json, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "mhmoe" or name.startswith("mhmoe."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
sys.meta_path.insert(0, Blocker())
try:
    import mhmoe
    sys.exit("mhmoe is importable")
except ModuleNotFoundError:
    pass
import torch
torch.set_num_threads(1)  # as the test process: bitwise-equal logits
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.set_verbosity_error()
logging.disable_progress_bar()
expected = torch.load(sys.argv[1], weights_only=True)
report = {}
for kind, want in expected.items():
    path = sys.argv[2] + "/" + kind
    try:
        AutoModelForCausalLM.from_pretrained(path)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(want["ids"]).logits
        tokens = model.generate(want["prompt"], max_new_tokens=want["steps"], do_sample=False, eos_token_id=None,
                                pad_token_id=model.config.eos_token_id)
    report[kind] = {"class": type(model).__module__ + "." + type(model).__name__, "refusal": refusal,
                    "logits_equal": bool(torch.equal(logits, want["logits"])),
                    "generate_equal": bool(torch.equal(tokens, want["tokens"])),
                    "mhmoe_modules": sorted(m for m in sys.modules if m.split(".")[0] == "mhmoe")}
print("\n" + json.dumps(report))
"""


def test_exported_model_loads_with_trust_remote_code_where_mhmoe_is_not_installed(tmp_path):
    """Every model kind: `mhmoe export --hf` writes config.json with auto_map and the model code, which
    transformers loads in an interpreter where `import mhmoe` fails, with our logits and greedy tokens;
    without trust_remote_code transformers' refusal names the flag."""
    import os
    import subprocess
    import sys

    from mhmoe.loading.checkpoint import load_checkpoint

    expected = {}
    for kind in ("mhmoe", "smoe", "dense", "bitnet"):
        ck_path = tiny_checkpoint(tmp_path / "runs" / kind, kind)
        assert main(["export", "--hf", str(tmp_path / "runs" / kind), str(tmp_path / "hf" / kind)]) == 0
        cfg = json.loads((tmp_path / "hf" / kind / "config.json").read_text())
        assert cfg["auto_map"] == {"AutoConfig": "modeling_mhmoe.MHMoEConfig",
                                   "AutoModelForCausalLM": "modeling_mhmoe.MHMoEForCausalLM"}
        code = [p.name for p in (tmp_path / "hf" / kind).glob("*.py")]
        assert {"modeling_mhmoe.py", "configuration_mhmoe.py", "mhmoe_model_lm.py"} <= set(code)
        assert all("from mhmoe" not in (tmp_path / "hf" / kind / f).read_text() for f in code)
        lm = load_checkpoint(ck_path).model.eval()
        ids, prompt = _ids(2, 12, seed=5), _ids(2, 5, seed=6)
        with torch.no_grad(), native.disabled():  # the exported code has no C++ ops: the Python path is its oracle
            expected[kind] = {"ids": ids, "logits": lm(ids).logits, "prompt": prompt, "steps": 10,
                              "tokens": generate(lm, prompt, 10, temperature=0)}
    torch.save(expected, tmp_path / "expected.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_MHMOE, str(tmp_path / "expected.pt"), str(tmp_path / "hf")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line (transformers may print before it)
    for kind, r in report.items():
        assert r["class"].endswith("modeling_mhmoe.MHMoEForCausalLM") and r["mhmoe_modules"] == [], (kind, r)
        assert r["logits_equal"] and r["generate_equal"], (kind, r)
        assert r["refusal"] is not None and "trust_remote_code=True" in r["refusal"], (kind, r)


def test_bundled_model_code_is_our_source_with_relative_imports():
    """Each bundled file is an mhmoe module byte for byte except its mhmoe import lines; lazy imports of
    modules outside the bundle (the Triton kernels) become an ImportError naming what to install; the
    only third-party imports are ones transformers installs."""
    import ast
    import importlib.util

    from mhmoe.integrations.hf import remote_code

    files = remote_code.bundle_sources()
    assert {"modeling_mhmoe.py", "configuration_mhmoe.py", "mhmoe_model_lm.py", "mhmoe_moe_layers.py",
            "mhmoe_quant_bitnet.py"} <= set(files)
    by_file = {remote_code.flat_name(m) + ".py": m for m in (
        "mhmoe.model.lm", "mhmoe.moe.routers", "mhmoe.moe.dispatch.triton.ops", *remote_code.ENTRY_MODULES)}
    for name, module in by_file.items():
        ours = open(importlib.util.find_spec(module).origin, encoding="utf-8").read().splitlines()
        theirs = files[name].split("\n\n\n# every file of this bundle")[0].splitlines()  # less the manifest
        assert len(ours) >= len(theirs)
        kept = [line for line in ours if "mhmoe" not in line or not line.lstrip().startswith(("from ", "import "))]
        assert [line for line in theirs if not line.lstrip().startswith(("from .", "raise ImportError("))] == [
            line for line in kept if not line.lstrip().startswith("from .")], name
    third_party = set()
    for name, text in files.items():
        tree = ast.parse(text)  # every file is valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] != "mhmoe", name
                third_party.add(node.module.split(".")[0])
    assert third_party - set(__import__("sys").stdlib_module_names) <= remote_code.ALLOWED_THIRD_PARTY
    manifest = files["modeling_mhmoe.py"].split("# every file of this bundle")[1]
    assert sorted(f"{line.split()[1][1:]}.py" for line in manifest.splitlines() if line.startswith("from .")) == sorted(
        set(files) - {"modeling_mhmoe.py"})
    # the Triton custom ops (and through them the kernels' launchers) stay outside
    assert "mhmoe.moe.dispatch.triton.custom_ops' + ' is not part of the exported model code" in files[
        "mhmoe_moe_dispatch_triton_ops.py"]
    assert not any("launch" in name or "backward" in name for name in files)


def test_transformers_activation_checkpointing_recomputes_every_block_with_the_same_gradients():
    """``gradient_checkpointing_enable()`` (what the transformers Trainer calls) turns on mhmoe's recomputation of
    every block (counted), with the gradients of the model without it; ``every_n_layers`` and disabling work; a
    training forward that fills a KV cache is never recomputed (it would append to the cache twice)."""
    import warnings

    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm).train()
    x = _ids(2, 10)

    def step(**kw):
        calls = []
        hooks = [b.attn.register_forward_pre_hook(lambda *_: calls.append(1)) for b in model.model.blocks]
        model.zero_grad(set_to_none=True)
        out = model(x, labels=x, **kw)
        out.loss.backward()
        for h in hooks:
            h.remove()
        return len(calls), [p.grad.clone() for p in model.parameters()], out

    n = len(model.model.blocks)
    plain_calls, plain, _ = step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.x renames the switch; both names work
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    calls, grads, _ = step()
    assert (plain_calls, calls) == (n, 2 * n)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    calls, grads, out = step(use_cache=True)
    assert calls == n and output_cache(out).get_seq_length() == 10
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    model._set_gradient_checkpointing(True, every_n_layers=2)
    assert [b.recompute for b in model.model.blocks] == ["block" if i % 2 == 0 else "none" for i in range(n)]
    assert n >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_disable()
        assert not model.is_gradient_checkpointing
    assert step()[0] == n
