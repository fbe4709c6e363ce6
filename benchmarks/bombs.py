"""Resource bombs before and after the bounded readers: peak memory, time, exit status and the length of
the error message of ``mhmoe`` reading each bomb, for the sources under ``--before`` (a checkout without
the limits) and this checkout::

    python benchmarks/bombs.py --before /path/to/old/src --json benchmarks/results/bombs.json

Every run is a child process under RLIMIT_AS = ``--memory-gib`` and RLIMIT_CPU = ``--cpu-s`` (so a
bomb that gets through is stopped there, and the row says so), one thread. The bombs are the ones of
``tests/bombs.py``; the DCP ones sit in a real sharded checkpoint (meta.json rehashed, as an attacker
would), read through ``mhmoe eval --checkpoint``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import bombs  # noqa: E402  (tests/bombs.py: the bomb builders and the limited runner)


def _rehash(ck: Path) -> None:
    meta = json.loads((ck / "meta.json").read_text())
    for name in meta["files"]:
        data = (ck / name).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ck / "meta.json").write_text(json.dumps(meta))


def _dcp_checkpoint(root: Path) -> Path:
    """A small sharded checkpoint (a 2-layer MH-MoE LM) written by this checkout."""
    import torch

    from mhmoe.checkpoint.write import save_checkpoint
    from mhmoe.config.model import ModelConfig
    from mhmoe.config.moe import MoEConfig
    from mhmoe.config.run import RunConfig
    from mhmoe.config.train import TrainConfig
    from mhmoe.data.tokenizer import ByteTokenizer
    from mhmoe.model.lm import LM
    from mhmoe.train.convert import safetensors_to_dcp

    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True)
    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, d_ff=32, max_seq_len=32, moe=moe)
    run = RunConfig(model=cfg, train=TrainConfig(seq_len=32))
    torch.manual_seed(0)
    src = save_checkpoint(root / "single", 1, LM(cfg), run, ByteTokenizer(), {"step": 1})
    return safetensors_to_dcp(src, root / "dcp-run")


def build(root: Path) -> list[tuple[str, str, list[str]]]:
    """(name, what it is, mhmoe arguments) for every bomb, written under ``root``."""
    from mhmoe.checkpoint.dcp_metadata import read_metadata

    cases = []
    (root / "laughs.yaml").write_text(bombs.billion_laughs())
    cases.append(("yaml-billion-laughs", f"{(root / 'laughs.yaml').stat().st_size} B YAML: 9 levels of 9 aliases",
                  ["train", "--config", str(root / "laughs.yaml"), "--out", str(root / "o1")]))
    (root / "deep.yaml").write_text(bombs.deep_yaml())
    cases.append(("yaml-deep", "200 KB YAML: sequences nested 100,000 deep",
                  ["train", "--config", str(root / "deep.yaml"), "--out", str(root / "o2")]))
    base = _dcp_checkpoint(root)

    def dcp_case(name: str, what: str, write) -> None:
        ck = root / name / "checkpoints" / base.name
        shutil.copytree(base, ck)
        write(ck)
        _rehash(ck)
        cases.append((name, what, ["eval", "--checkpoint", str(ck), "--batches", "1"]))

    dcp_case("dcp-deep-key", "3 MB .metadata: a dict key nested 3,000,000 deep",
             lambda ck: (ck / "dcp" / ".metadata").write_bytes(bombs.deep_tuple_key()))
    dcp_case("dcp-repeated-path", "1 MB .metadata: one 1 MB string joined 1000 times into a path",
             lambda ck: (ck / "dcp" / ".metadata").write_bytes(bombs.repeated_path()))
    dcp_case("dcp-shared-chunks", "0.3 MB .metadata: 20,000 tensors sharing one list of 20,000 chunks",
             lambda ck: (ck / "dcp" / ".metadata").write_bytes(bombs.shared_chunks_metadata()))

    def aliased(ck: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        big = ck / "dcp"
        shutil.rmtree(big)
        dcp.save({"model": {"w": torch.zeros(2_000_000)}, "optim": {}}, checkpoint_id=str(big), no_dist=True)
        md = bombs.aliased_chunks_metadata(read_metadata(big / ".metadata"), copies=100)
        (big / ".metadata").write_bytes(pickle.dumps(md))

    dcp_case("dcp-aliased-chunks", "8 MB of data, 101 tensors whose chunks all point at it", aliased)
    dcp_case("torch-deep-key", "0.3 MB trainer_state.pt: a dict key nested 300,000 deep",
             lambda ck: (ck / "trainer_state.pt").write_bytes(bombs.torch_archive(bombs.deep_tuple_key(300_000))))
    dcp_case("json-deep-meta", "200 KB meta.json nested 100,000 deep", lambda ck: None)
    (root / "json-deep-meta" / "checkpoints" / base.name / "meta.json").write_text(bombs.deep_json())  # after _rehash
    archive_cases(root, dcp_case, cases)
    return cases


def archive_cases(root: Path, dcp_case, cases: list) -> None:
    """Compression inside archives and data files, cost bombs of the pickle walk and the .metadata
    reader, special files given as a config."""
    from mhmoe.checkpoint.dcp_metadata import read_metadata

    deflated = bombs.deflated_torch_archive(1 << 30)
    dcp_case("torch-deflated", f"{len(deflated) / 1e6:.1f} MB trainer_state.pt: a 1 GiB tensor, deflated",
             lambda ck: (ck / "trainer_state.pt").write_bytes(deflated))

    def deflated_item(ck: Path) -> None:  # one tensor's item replaced by the deflated archive, appended
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        md = read_metadata(ck / "dcp" / ".metadata")
        data = ck / "dcp" / "__0_0.distcp"
        idx = next(k for k in md.storage_data if k.fqn.startswith("model."))
        md.storage_data[idx] = _StorageInfo(data.name, data.stat().st_size, len(deflated))
        with open(data, "ab") as f:
            f.write(deflated)
        (ck / "dcp" / ".metadata").write_bytes(pickle.dumps(md))

    dcp_case("dcp-deflated-item", f"{len(deflated) / 1e6:.1f} MB DCP item: a 1 GiB tensor, deflated", deflated_item)
    ops = bombs.pickle_of_ops((32 << 20) - 16)  # just under the limit: walked, not refused for its size
    dcp_case("torch-pickle-ops", "32 MB data.pkl (the limit) of one-byte opcodes in trainer_state.pt",
             lambda ck: (ck / "trainer_state.pt").write_bytes(bombs.torch_archive(ops)))
    for name, what, bomb in (
            ("dcp-int-keys", "0.65 MB .metadata: 50,000 int keys k * (2**61 - 1), one hash",
             lambda: bombs.colliding_int_keys(50_000)),
            ("dcp-index-keys", "0.3 MB .metadata: 4,000 MetadataIndex keys with one hash",
             lambda: bombs.colliding_index_keys(4000)),
            ("dcp-empty-sets", "20 MB .metadata: 20,000,000 EMPTY_SET opcodes", lambda: bombs.empty_sets(20_000_000))):
        dcp_case(name, what, lambda ck, bomb=bomb: (ck / "dcp" / ".metadata").write_bytes(bomb()))
    gz = root / "data" / "bomb.txt.gz"
    gz.parent.mkdir()
    gz.write_bytes(bombs.gzip_bomb(1 << 30))
    cases.append(("gz-data", f"{gz.stat().st_size / 1e6:.1f} MB --data .txt.gz: 1 GiB of text",
                  ["train", "--preset", "tiny-mh3", "--data", str(gz), "--out", str(root / "o3"), "--no-progress"]))
    cases.append(("config-dev-zero", "--config /dev/zero",
                  ["train", "--config", "/dev/zero", "--out", str(root / "o4")]))


def measure(args_: list[str], src: Path, memory: int, cpu_s: int) -> dict:
    out = bombs.run_limited(bombs.cli(args_), memory=memory, cpu_s=cpu_s, timeout=cpu_s * 3, src=src)
    lines = out.stderr.strip().splitlines()
    return {"status": out.status, "max_rss_mb": round(out.max_rss_mb, 1), "seconds": round(out.seconds, 2),
            "stderr_bytes": len(out.stderr.encode()), "stderr_lines": len(lines),
            "last_line": (lines[-1] if lines else "")[:240]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="src directory of the code without the limits")
    ap.add_argument("--before-commit", default=None, help="the commit --before was exported from (for the record)")
    ap.add_argument("--memory-gib", type=float, default=4.0)
    ap.add_argument("--cpu-s", type=int, default=120)
    ap.add_argument("--only", nargs="*", default=None, help="bomb names to run (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the rows of --json that were not run now (each row "
                    "records its own commits, machine and date)")
    args = ap.parse_args(argv)
    memory = int(args.memory_gib * 2**30)
    root = Path(tempfile.mkdtemp(prefix="mhmoe-bombs-"))
    rows = []
    try:
        baseline = {name: measure(["presets"], src, memory, args.cpu_s)["max_rss_mb"]
                    for name, src in (("before", Path(args.before)), ("after", ROOT / "src"))}
        for name, what, cli_args in build(root):
            if args.only and name not in args.only:
                continue
            shown = " ".join(a.replace(root.as_posix(), "$TMP") for a in cli_args)
            row = {"bomb": name, "what": what, "command": f"mhmoe {shown}"}
            for label, src in (("before", Path(args.before)), ("after", ROOT / "src")):
                row[label] = measure(cli_args, src, memory, args.cpu_s)
                print(f"{name:22s} {label:6s} exit {row[label]['status']:4d}  {row[label]['max_rss_mb']:8.0f} MB "
                      f"{row[label]['seconds']:7.1f} s  stderr {row[label]['stderr_bytes']:,} B", file=sys.stderr)
            rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "rows": rows, "baseline_rss_mb": baseline, "memory_limit_gib": args.memory_gib, "cpu_limit_s": args.cpu_s,
        "before_commit": args.before_commit or _commit(Path(args.before)), "after_commit": _commit(ROOT / "src"),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/bombs.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
    }
    if args.json:
        if args.merge and Path(args.json).is_file():
            result = merged(json.loads(Path(args.json).read_text(encoding="utf-8")), result)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def merged(old: dict, new: dict) -> dict:
    """``old``'s rows with those of ``new`` replaced or added; every row keeps its own before/after commits,
    machine, limits and date (``new``'s top-level ones describe the last run)."""
    keys = ("before_commit", "after_commit", "machine", "date", "memory_limit_gib", "cpu_limit_s", "baseline_rss_mb")

    def own(row: dict, top: dict) -> dict:
        return {**{k: top[k] for k in keys if k in top}, **row}

    rows = {r["bomb"]: own(r, old) for r in old["rows"]}
    rows.update({r["bomb"]: own(r, new) for r in new["rows"]})
    return {**new, "rows": list(rows.values())}


def _commit(src: Path) -> str:
    res = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return res.stdout.strip() or "unknown"


def _cpu() -> str:
    from mhmoe.runtime.cpu import cpu_info

    return cpu_info()[0]


if __name__ == "__main__":
    sys.exit(main())
