"""Routing of image patches in a masked multi-modal encoder: the ICML paper's Fig. 8.

``mhmoe analyze --checkpoint RUN`` on an encoder run (``model.arch=encoder``) runs the model on the
validation images, each alone and unmasked (``[CLS] v_1 .. v_P [SEP]``, the image rows of
:mod:`mhmoe.data.multimodal`), and writes into the output directory:

- the routing statistics of :mod:`mhmoe.research.analysis` over those sequences (activation,
  sub-token assign diversity, router entropy, load imbalance; ``summary.json``, ``activation.*``,
  ``diversity.*``);
- ``fig8.png``: per image, the picture, then its patch map of **assign diversity** (the number of
  distinct experts a patch's H sub-tokens are routed to, mean over the MoE layers; brighter = more
  experts, as in ICML Fig. 8) for up to three checkpoints of the run, oldest to newest (ICML Fig. 8
  shows 100k, 200k and 250k steps), and last the patches of the newest checkpoint cut into their H
  sub-tokens, each coloured by the expert it goes to (its top-1 slot) in the last MoE layer;
- ``fig8.json``: those maps as numbers (``diversity[step][image]`` rows x cols, ``experts[image]``
  rows x cols x H).

Shape legend: N images, P = rows * cols patches, T = P + 2 positions, H heads, K top-k, L MoE layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.checkpoint.layout import is_checkpoint_dir, step_of
from mhmoe.data.multimodal import MODALITY_IMAGE, SPECIALS, MaskedMultimodalData
from mhmoe.errors import ConfigError
from mhmoe.loading.checkpoint import Checkpoint, load_checkpoint, load_latest
from mhmoe.research.analysis import collect_routing, summarize, write_report
from mhmoe.runtime.files import atomic_write
from mhmoe.train.objectives import MaskedMultimodalObjective, build_objective

MAX_STEPS_SHOWN = 3  # checkpoints (columns) in fig8.png: the oldest, the newest and one between


class ImageSequences(nn.Module):
    """The encoder seen as ``model(x, return_routing=...)`` on image-only sequences ``x`` [N, T]
    (``[CLS]`` + P codes + ``[SEP]``, no padding), so :func:`~mhmoe.research.analysis.collect_routing`
    can run it: modality and patch positions follow from the grid."""

    def __init__(self, encoder: nn.Module, grid: tuple[int, int]) -> None:
        super().__init__()
        self.encoder, self.grid = encoder, grid

    def forward(self, x: Tensor, return_routing: bool = False):
        rows, cols = self.grid
        n, t = x.shape
        if t != rows * cols + 2:
            raise ValueError(f"image sequences have {rows * cols + 2} positions, got {t}")
        k = torch.arange(rows * cols, device=x.device)
        pos = torch.full((t, 2), -1, dtype=torch.long, device=x.device)
        pos[1:-1, 0], pos[1:-1, 1] = k // cols, k % cols
        modality = torch.full_like(x, MODALITY_IMAGE)
        return self.encoder(x, modality, pos.expand(n, t, 2), None, return_routing=return_routing)


def image_inputs(data: MaskedMultimodalData, indices: list[int]) -> Tensor:
    """Unmasked image-only sequences of ``indices``: int64 [N, P + 2]."""
    t = data.images.n_patches + 2
    return torch.cat([data.image_example(i, mask=False).input_ids[:, :t] for i in indices])


def diversity_maps(model: nn.Module, data: MaskedMultimodalData, indices: list[int], batch_size: int,
                   device: torch.device | str) -> tuple[list, np.ndarray]:
    """Routing records of the image sequences of ``indices`` and their patch maps of assign diversity
    (mean over MoE layers): float64 [N, rows, cols]."""
    x = image_inputs(data, indices)
    batches = [(x[i:i + batch_size], None) for i in range(0, len(x), batch_size)]
    records, _ = collect_routing(ImageSequences(model, data.grid), batches, device)
    if not records:
        raise ConfigError("--checkpoint", "(dense model)", "a run with MoE layers to analyse")
    div = torch.stack([torch.cat(r.diversity).double() for r in records]).mean(0)  # [N * T]
    maps = div.view(len(indices), -1)[:, 1:-1].reshape(len(indices), *data.grid)
    return records, maps.numpy()


@torch.no_grad()
def subtoken_experts(model: nn.Module, data: MaskedMultimodalData, indices: list[int],
                     device: torch.device | str) -> np.ndarray:
    """Expert of every patch's H sub-tokens (their highest-weight valid slot; -1 when none) in the last
    MoE layer: int64 [N, rows, cols, H]."""
    model.eval()
    x = image_inputs(data, indices).to(device)
    out = ImageSequences(model, data.grid)(x, return_routing=True)
    route = out.layer_outputs[-1].route
    weights = torch.where(route.valid, route.weights, -1.0)
    best = weights.argmax(-1, keepdim=True)
    experts = torch.where(route.valid.any(-1, keepdim=True), route.experts.gather(-1, best), -1).squeeze(-1)
    n, t = x.shape
    e = experts.view(n, t, -1)[:, 1:-1].reshape(n, *data.grid, -1)
    return e.cpu().numpy()


def _decode(data: MaskedMultimodalData, tokenizer):
    """Token names for the report: text via the tokenizer, visual codes as ``<v12>``, the specials."""
    v = data.vocab

    def decode(ids: list[int]) -> str:
        i = int(ids[0])
        if i < v.code_offset:
            return tokenizer.decode([i])
        if i < v.pad_id:
            return f"<v{i - v.code_offset}>"
        return SPECIALS[i - v.pad_id]

    return decode


def spread(items: list, n: int) -> list:
    """At most ``n`` items evenly spread over ``items``, the first and the last included."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else [items[-1]]


def _steps(checkpoint: str | Path, newest: Checkpoint) -> list[Path]:
    """The checkpoints whose maps fig8.png shows: MAX_STEPS_SHOWN of the run's, spread from its oldest
    kept checkpoint to the newest valid one; or only the checkpoint given."""
    p = Path(checkpoint)
    if is_checkpoint_dir(p):
        return [newest.path]
    paths = [c for c in list_checkpoints(p) if (step_of(c.name) or 0) <= newest.step]
    return spread(paths, MAX_STEPS_SHOWN) or [newest.path]


def analyze_encoder_checkpoint(checkpoint: str | Path, out_dir: str | Path, batches: int = 8,
                               threshold: float = 0.01, device: str | torch.device = "cpu",
                               n_images: int = 6) -> dict:
    """Routing analysis of an encoder run on its validation images and the Fig. 8 picture (module docstring)."""
    ck = load_latest(checkpoint, device)
    if ck.run.model.arch != "encoder":
        raise ConfigError("--checkpoint", str(checkpoint), "an encoder run (model.arch=encoder)")
    task = build_objective(ck.run, tokenizer=ck.tokenizer)
    assert isinstance(task, MaskedMultimodalObjective)
    data, batch_size = task.data, ck.run.train.batch_size
    val = [int(i) for i in data.split_images["val"]]
    records, _ = diversity_maps(ck.model, data, val[:batches * batch_size], batch_size, device)
    summary = summarize(records, threshold)
    summary["checkpoint"] = str(ck.path)
    ids = [image_inputs(data, val[:batches * batch_size]).reshape(-1)]
    summary = write_report(summary, ids, _decode(data, ck.tokenizer), out_dir)
    shown = val[:n_images]
    maps = {}
    for path in _steps(checkpoint, ck):
        c = ck if path == ck.path else load_checkpoint(path, device)
        maps[c.step] = diversity_maps(c.model, data, shown, batch_size, device)[1]
    experts = subtoken_experts(ck.model, data, shown, device)
    draw_fig8(out_dir, [data.image(i) for i in shown], [data.caption(i) for i in shown], maps, experts,
              ck.run.model.moe.n_experts, max_diversity=summary["max_possible_diversity"],
              random_diversity=float(np.mean(summary["random_routing"]["expected_assign_diversity_per_layer"])))
    atomic_write(Path(out_dir) / "fig8.json", json.dumps({
        "images": shown, "captions": [data.caption(i) for i in shown], "grid": list(data.grid),
        "diversity": {str(s): np.round(m, 4).tolist() for s, m in maps.items()}, "experts": experts.tolist(),
    }))
    summary["fig8"] = str(Path(out_dir) / "fig8.png")
    return summary


def _subgrid(h: int) -> tuple[int, int]:
    """Sub-token cells per patch as (rows, cols): the most square factorisation of H (4 -> 2x2, 6 -> 2x3)."""
    r = max(d for d in range(1, int(math.isqrt(h)) + 1) if h % d == 0)
    return r, h // r


def expert_canvas(experts: np.ndarray) -> np.ndarray:
    """[rows, cols, H] expert ids -> [rows * r, cols * c] ids, each patch cut into its r x c sub-tokens
    (sub-token j at cell (j // c, j % c), the token-major order of the split)."""
    rows, cols, h = experts.shape
    r, c = _subgrid(h)
    return experts.reshape(rows, cols, r, c).transpose(0, 2, 1, 3).reshape(rows * r, cols * c)


def draw_fig8(out_dir: str | Path, images: list[np.ndarray], captions: list[str], maps: dict[int, np.ndarray],
              experts: np.ndarray, n_experts: int, max_diversity: int, random_diversity: float | None = None) -> Path:
    """fig8.png: one row per image: the picture, a diversity map per checkpoint step, the sub-token experts.
    The colour bar marks ``random_diversity`` (expected distinct experts per patch under random routing)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(maps)
    ncols = 2 + len(steps)
    fig, axes = plt.subplots(len(images), ncols, figsize=(1.9 * ncols, 1.9 * len(images)), squeeze=False)
    cmap = plt.get_cmap("tab20" if n_experts <= 20 else "turbo", n_experts)
    for i, img in enumerate(images):
        ax = axes[i]
        ax[0].imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None)
        ax[0].set_ylabel("\n".join(textwrap.wrap(captions[i], 22, max_lines=2, placeholder="..")), fontsize=7)
        rows, cols = maps[steps[0]][i].shape
        extent = (0, cols, rows, 0)  # every panel covers the image's patch grid
        for j, s in enumerate(steps):
            im = ax[1 + j].imshow(maps[s][i], cmap="inferno", vmin=1, vmax=max(1, max_diversity), extent=extent)
            if i == 0:
                ax[1 + j].set_title(f"diversity\nstep {s}", fontsize=8)
        canvas = np.ma.masked_less(expert_canvas(experts[i]), 0)
        ax[-1].imshow(canvas, cmap=cmap, vmin=-0.5, vmax=n_experts - 0.5, interpolation="nearest", extent=extent)
        if i == 0:
            ax[0].set_title("image", fontsize=8)
            ax[-1].set_title(f"sub-token experts\nstep {steps[-1]}", fontsize=8)
        for a in ax:
            a.set_xticks([])
            a.set_yticks([])
    label = "diversity: distinct experts per patch"
    bar = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.5, label=label)
    if random_diversity is not None:
        bar.ax.axhline(random_diversity, color="tab:cyan", linestyle="--", linewidth=2)
        bar.set_label(f"{label}\n(dashed: random routing, {random_diversity:.2f})")
    from matplotlib.ticker import MaxNLocator

    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    path = Path(out_dir) / "fig8.png"
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path
