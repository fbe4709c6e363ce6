"""Convert a training checkpoint into a Hugging Face model directory (``mhmoe export --hf``)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.errors import CheckpointError
from mhmoe.integrations.hf.modeling_mhmoe import MHMoEForCausalLM
from mhmoe.integrations.hf.tokenization import to_hf_tokenizer
from mhmoe.runtime.files import publish_dir, staging_dir
from mhmoe.train.checkpoint import Checkpoint

OUR_TOKENIZER_DIR = "mhmoe_tokenizer"  # our own tokenizer files, for mhmoe tools reading the export


@dataclass
class HFExportReport:
    path: str
    step: int
    params: int
    files: list[str]
    max_abs_logit_diff: float  # exported model reloaded with from_pretrained vs the checkpoint's model

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_hf(ck: Checkpoint, out: str | os.PathLike[str]) -> HFExportReport:
    """Write ``ck`` as ``config.json`` + ``model.safetensors`` + ``tokenizer.json`` (+ our tokenizer
    under ``mhmoe_tokenizer/``) into ``out``, which must not exist or be empty. Everything is written
    into a hidden temporary sibling, reloaded with ``from_pretrained`` and compared with the
    checkpoint's logits, then renamed into place: ``out`` is never left half-written."""
    if ck.run.model.arch != "decoder":
        raise CheckpointError(f"{ck.path}: model.arch={ck.run.model.arch}; the transformers export is for decoders")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists and is not an empty directory (refusing to overwrite)")
    with staging_dir(out) as tmp:  # a fresh hidden sibling (mhmoe.runtime.files), removed on failure
        model = MHMoEForCausalLM.from_lm(ck.model.float().cpu(), eos_token_id=ck.tokenizer.eos_id)
        model.save_pretrained(tmp, safe_serialization=True)
        to_hf_tokenizer(ck.tokenizer, model_max_length=ck.model.cfg.max_seq_len).save_pretrained(tmp)
        ck.tokenizer.save(tmp / OUR_TOKENIZER_DIR)
        reloaded = MHMoEForCausalLM.from_pretrained(tmp).eval()
        n = min(32, ck.model.cfg.max_seq_len)
        idx = torch.randint(0, ck.model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = float((reloaded(idx).logits - ck.model.eval()(idx).logits).abs().max())
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        publish_dir(tmp, out)  # fsync'd, renamed into place; a symlink at out is refused
    return HFExportReport(str(out), ck.step, sum(p.numel() for p in ck.model.parameters()), files, diff)
