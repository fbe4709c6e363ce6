"""``mhmoe reproduce SUITE``: train the matched models of one of the papers' tables, evaluate them and
print our table beside the paper's -- honestly, whatever the result.

A suite is a list of rows (label + run config) with its settings (:mod:`mhmoe.research.suites`: the
primary comparisons, seeds per row, evaluations per run, an epoch limit). Every run is trained **once**
in the run store (:mod:`mhmoe.research.store`; default ``store/`` beside the suite folder, so the suites of
one parent folder share it): its key is the hash of what it computes, so a model that appears in several
suites under different labels (or again after an interruption) is reused, not retrained. A run whose
record exists is reused without its run directory (records can be committed and the suite completed on
another machine). Older suite folders that hold their runs as ``OUT/<label>/seed<k>/`` keep reporting
(and resuming) them there.

Two processes may run the same command on the same folders: each trains the next run nobody is training
(a run directory is locked while it trains), then waits for the runs the other holds, and both write the
complete table. The outputs are :mod:`mhmoe.research.tables`'s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mhmoe.checkpoint.layout import CONFIG_FILE, RESULTS_FILE
from mhmoe.config.presets import SCALES
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.research.report import read_results_md
from mhmoe.research.store import (
    BOOKKEEPING,
    RunStore,
    first_difference,
    identity,
    make_record,
    no_symlink_below,
    run_key,
)
from mhmoe.research.suites import (
    SETTINGS,
    SUITE_BLOCKS,
    SUITE_SCALES,
    SUITES,
    Row,
    primary_labels,
    select_rows,
    suite_rows,
    suite_settings,
)
from mhmoe.research.tables import summarize_results, write_outputs
from mhmoe.runtime.files import atomic_write, make_dirs
from mhmoe.runtime.reading import read_json, regular_or_missing

__all__ = ["BOOKKEEPING", "SETTINGS", "SUITES", "SUITE_BLOCKS", "SUITE_SCALES", "Row", "run_suite", "run_table",
           "select_rows", "suite_rows", "suite_status", "table_status", "summarize_results", "write_outputs"]

WAIT_POLL_S = 30.0  # how often a process waiting for another's run looks again
EPOCH_WARNING = 2.0  # runs past this many epochs of their training corpus are warned about


def run_table(name: str, out: str | Path, **kwargs) -> list[dict]:
    """:func:`run_suite` for ``name`` and then for each of its blocks (:data:`SUITE_BLOCKS`) in
    ``OUT/<block>/``; ``OUT/results.md`` then holds every block's table (CSV and curves stay per block).
    Report-only (``train_missing=False``) leaves out the blocks without a finished run."""
    out = Path(out)
    parts = [(name, out)] + [(b, out / b) for b in SUITE_BLOCKS.get(name, ())]
    if len(parts) == 1:
        return run_suite(name, out, **kwargs)
    results, tables = [], []
    for suite, where in parts:
        try:
            results += run_suite(suite, where, **kwargs)
        except ConfigError:
            if kwargs.get("train_missing", True):
                raise
            continue  # report-only: a block without finished runs is left out
        tables.append(read_results_md(where))  # a symlink, a FIFO, an oversized file: one line naming it
    if not results:
        raise ConfigError("--out", str(out), f"a directory with finished {name} runs (--report-only trains nothing)")
    atomic_write(out / "results.md", "\n".join(tables))
    return results


def table_status(name: str, out: str | Path, **kwargs) -> dict[str, dict[str, dict[str, list[int]]]]:
    """:func:`suite_status` of ``name`` (in ``out``) and of each of its blocks (in ``OUT/<block>/``), by suite."""
    out = Path(out)
    parts = [(name, out)] + [(b, out / b) for b in SUITE_BLOCKS.get(name, ())]
    return {suite: suite_status(suite, where, **kwargs) for suite, where in parts}


def run_dir_name(label: str) -> str:
    """The folder name of a row's runs in an older suite folder (ASCII letters, digits, ``-_.``)."""
    label = label.replace("✓", "on").replace("✗", "off").replace(" ", "_")
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in label)


def _run_dir(out: Path, label: str, seed: int) -> Path:
    return out / run_dir_name(label) / f"seed{seed}"


def seeds_per_row(name: str, rows: list[Row], seeds: int | None) -> dict[str, int]:
    """``--seeds N``: N for every row; default: the suite's primary rows ``primary_seeds``, others ``other_seeds``."""
    if seeds is not None and seeds < 1:
        raise ConfigError("--seeds", seeds, "an integer >= 1")
    st, primary = suite_settings(name), primary_labels(name)
    return {row.label: seeds or (st.primary_seeds if row.label in primary else st.other_seeds) for row in rows}


@dataclass
class Planned:
    row: Row
    seed: int  # the seed index k (train.seed = the row's seed + k)
    run: RunConfig


def _resolver(name: str, built: dict[str, RunConfig],
              overrides: list[str]) -> Callable[[str, int | None, int], RunConfig]:
    """``resolve(label, tokens, k)``: the row's run at ``tokens`` per run (None: its preset's steps), seed k;
    ``train.eval_every`` = ceil(steps / the suite's evaluations per run), so a run evaluates at most that
    many times, the final evaluation included (unless an override sets it)."""
    points = suite_settings(name).curve_points

    def resolve(label: str, tokens: int | None, k: int = 0) -> RunConfig:
        base = built[label]
        resolved = base.with_overrides(overrides)
        steps = max(1, tokens // resolved.train.tokens_per_step) if tokens else resolved.train.max_steps
        sets = [f"train.eval_every={-(-steps // points)}", f"train.max_steps={steps}"]
        return base.with_overrides(sets + overrides + [f"train.seed={base.train.seed + k}"])
    return resolve


def run_suite(name: str, out: str | Path, scale: str = "tiny", seeds: int | None = None, tokens: int | None = None,
              overrides: list[str] | None = None, progress: bool = True, train_missing: bool = True,
              only: list[str] | None = None, minutes: float | None = None, store: str | Path | None = None,
              records: str | Path | None = None, first_seed: int = 0) -> list[dict]:
    """Train (or reuse) every row x seed of suite ``name``; write the suite's outputs into ``out``.

    ``seeds``: per row (default: the suite's, :func:`seeds_per_row`), the seed indices ``first_seed`` ..
    ``first_seed + seeds - 1`` (seed k trains with the row's ``train.seed + k``: a fresh set of seeds, e.g. a
    confirmatory run after an exploratory one, starts past the seeds already trained). ``train_missing=False``
    trains nothing and reports the runs that already finished (an error if none). ``only``: the labels of the rows to
    train and report. ``minutes``: instead of ``tokens``, the wall-clock budget of the whole suite
    (:mod:`mhmoe.research.budget`, ``OUT/budget.json``). ``store`` / ``records``: the run store's folder
    (default ``OUT/../store``) and its records' folder (default ``STORE/records``).
    """
    out = Path(out)
    suite = _plan(name, out, scale, seeds, tokens, overrides, only, minutes, first_seed)
    runner = _Runner(name, out, RunStore(store or out.parent / "store", records), progress, train_missing,
                     [p.run for p in suite.plan])
    if train_missing:
        runner.check_epochs(suite.plan, suite_settings(name).max_epochs)
    results = runner.run(suite.plan)
    if not results:
        raise ConfigError("--out", str(out), f"a directory with finished {name} runs (--report-only trains nothing)")
    write_outputs(name, suite.rows, results, out, suite.budget, runner.environment())
    return results


def suite_status(name: str, out: str | Path, scale: str = "tiny", seeds: int | None = None,
                 tokens: int | None = None, overrides: list[str] | None = None, only: list[str] | None = None,
                 minutes: float | None = None, store: str | Path | None = None, records: str | Path | None = None,
                 first_seed: int = 0) -> dict[str, dict[str, list[int]]]:
    """Where the runs of :func:`run_suite` with these arguments stand, without their results (a run planned in
    advance is analysed once, at its end): per row label, the seed indices ``finished``, ``training`` (another
    process holds the run's directory now), ``interrupted`` (a run directory without a finished run: the next
    ``run_suite`` resumes it from its last checkpoint) and ``to_train``. Trains nothing; with ``minutes``, the suite
    directory's ``budget.json`` for these minutes must exist (no calibration runs here)."""
    out = Path(out)
    suite = _plan(name, out, scale, seeds, tokens, overrides, only, minutes, first_seed, calibrate=False)
    runner = _Runner(name, out, RunStore(store or out.parent / "store", records), False, False,
                     [p.run for p in suite.plan])
    status: dict[str, dict[str, list[int]]] = {
        row.label: {"finished": [], "training": [], "interrupted": [], "to_train": []} for row in suite.rows}
    for p in suite.plan:
        status[p.row.label][runner.state(p)].append(p.seed)
    return status


@dataclass
class _Suite:
    rows: list[Row]
    plan: list[Planned]  # seed-major: both rows of seed k before seed k + 1
    budget: dict | None


def _plan(name: str, out: Path, scale: str, seeds: int | None, tokens: int | None, overrides: list[str] | None,
          only: list[str] | None, minutes: float | None, first_seed: int, calibrate: bool = True) -> _Suite:
    """The rows and planned runs of :func:`run_suite`'s arguments (every override checked first), and the budget of
    ``minutes`` (calibrated here unless ``calibrate`` is False: then ``OUT/budget.json`` must hold it)."""
    if scale not in SUITE_SCALES or scale not in SCALES:
        raise ConfigError("--scale", scale, " | ".join(s for s in SUITE_SCALES if s in SCALES))
    overrides = list(overrides or [])
    rows = select_rows(name, only)
    n_seeds = seeds_per_row(name, rows, seeds)
    if first_seed < 0:
        raise ConfigError("--first-seed", first_seed, "an integer >= 0")
    built = {row.label: row.build(scale) for row in rows}
    resolve = _resolver(name, built, overrides)
    runs0 = {label: resolve(label, None) for label in built}  # checks every override before anything trains
    budget = None
    if minutes is not None:
        if tokens:
            raise ConfigError("--tokens", tokens, "no --tokens with --minutes (the budget sets the tokens)")
        from mhmoe.research.budget import suite_budget

        budget = suite_budget(out, name, runs0, n_seeds, minutes, lambda label, t: resolve(label, t),
                              may_calibrate=calibrate)
        tokens = _capped(name, budget)
    plan = [Planned(row, first_seed + i, resolve(row.label, tokens, first_seed + i))  # seed-major
            for i in range(max(n_seeds.values())) for row in rows if i < n_seeds[row.label]]
    return _Suite(rows, plan, budget)


def _capped(name: str, budget: dict) -> int:
    """The budget's tokens per run, at most the suite's epoch limit of its corpus (said in one line)."""
    tokens, limit, corpus = budget["tokens_per_run"], suite_settings(name).max_epochs, budget.get("train_tokens")
    if limit is None or not corpus or tokens <= limit * corpus:
        return tokens
    capped = int(limit * corpus)
    print(f"[{name}] the budget allows {tokens:,} tokens per run; {limit:g} epoch(s) of the corpus is {capped:,}: "
          "training that (the suite ends before its budget)", file=sys.stderr)
    return capped


def _check_same_run(run_dir: Path, run: RunConfig) -> None:
    """A run reused from an older suite folder must have been trained with the same config (bookkeeping
    fields aside)."""
    saved = run_dir / CONFIG_FILE
    if not regular_or_missing(saved):  # a symlink, a FIFO: one line naming it
        return
    diff = first_difference(identity(RunConfig.load(saved)), identity(run))
    if diff:
        raise ConfigError("--out", str(run_dir), f"a directory without a different run in it ({diff}); use "
                          "another --out")


class _Runner:
    """Trains (or finds) the planned runs of one suite invocation."""

    def __init__(self, name: str, out: Path, store: RunStore, progress: bool, train_missing: bool,
                 runs: list[RunConfig]) -> None:
        self.name, self.out, self.store, self.progress, self.train_missing = name, out, store, progress, train_missing
        self.runs = runs
        self.versions: dict[str, dict | None] = {}
        self._env: dict | None = None

    def environment(self) -> dict:
        """This process's environment (:mod:`mhmoe.research.provenance`) for the planned runs' devices and
        threads (``train.threads``; 0: torch's default, recorded beside it)."""
        from mhmoe.research.provenance import environment
        from mhmoe.runtime.device import resolve_device

        if self._env is None:
            devices = sorted({resolve_device(r.train.device).type for r in self.runs}) or ["cpu"]
            threads = sorted({r.train.threads for r in self.runs})
            self._env = environment(devices, threads[0] if len(threads) == 1 else None)
        return self._env

    def _say(self, p: Planned, what: str) -> None:
        print(f"[{self.name}] {p.row.label} seed {p.seed}: {what}", file=sys.stderr, flush=True)

    def corpus_tokens(self, run: RunConfig) -> int | None:
        """The training tokens of ``run``'s corpus (:meth:`data_version`)."""
        version = self.data_version(run)
        return None if version is None else version["train_tokens"]

    def data_version(self, run: RunConfig) -> dict | None:
        """``run``'s data version (:func:`mhmoe.research.epochs.data_version`), its corpus prepared (tokenized
        and cached) here the first time: processes sharing the store take turns (``STORE/.data.lock``), so a
        second one finds the cache."""
        from filelock import FileLock

        from mhmoe.research.epochs import data_version

        key = repr(run.data)
        if key not in self.versions:
            make_dirs(self.store.root)
            print(f"[{self.name}] data: {run.data.corpus} (prepared once and cached; a process sharing the store "
                  "waits for it)", file=sys.stderr, flush=True)
            with FileLock(str(self.store.root / ".data.lock")):
                self.versions[key] = data_version(run, progress=self.progress)
        return self.versions[key]

    def check_epochs(self, plan: list[Planned], max_epochs: float | None) -> None:
        """Refuse runs past the suite's epoch limit and warn (one line) past :data:`EPOCH_WARNING` epochs,
        before anything trains; only runs still to train are counted."""
        todo = [p for p in plan if self.find(p) is None]
        worst = max(((p.run.train.max_steps * p.run.train.tokens_per_step / t, p) for p in todo
                     if (t := self.corpus_tokens(p.run))), default=None, key=lambda e: e[0])
        if worst is None:
            return
        epochs, p = worst
        corpus = p.run.data.corpus
        if max_epochs is not None and epochs > max_epochs:
            raise ConfigError("--tokens", p.run.train.max_steps * p.run.train.tokens_per_step,
                              f"at most {max_epochs:g} epoch(s) of {corpus} per run in suite {self.name} "
                              f"({self.corpus_tokens(p.run):,} training tokens; this is {epochs:.2f})")
        if epochs > EPOCH_WARNING:
            print(f"mhmoe: warning: {self.name}: runs train {epochs:.1f} epochs of {corpus} (more than "
                  f"{EPOCH_WARNING:g}: the models see the same text again and again)", file=sys.stderr)

    def find(self, p: Planned) -> dict | None:
        """The finished run of ``p`` as a results entry (an older folder's run, or a store record)."""
        legacy = _run_dir(self.out, p.row.label, p.seed)
        no_symlink_below(self.out, legacy)  # a symlinked row or seed directory leads out of the folder
        if regular_or_missing(legacy / RESULTS_FILE):  # a symlink, a FIFO: one line naming it
            _check_same_run(legacy, p.run)
            results = read_json(legacy / RESULTS_FILE, follow=False, what=RESULTS_FILE)
            return self.entry(p, make_record(p.run, legacy, results, None), legacy)
        rec = self.store.finished(p.run)
        return None if rec is None else self.entry(p, rec, self.store.run_dir(rec["key"]))

    def entry(self, p: Planned, rec: dict, run_dir: Path) -> dict:
        return {"label": p.row.label, "seed": p.seed, "train_seed": p.run.train.seed, "run_dir": str(run_dir),
                "key": rec["key"], **rec["results"], "curve": rec.get("curve") or [],
                "train_curve": rec.get("train_curve") or [], "tokens_seen": rec.get("tokens_seen"),
                "corpus": p.run.data.corpus, "train_tokens": rec.get("train_tokens"), "epochs": rec.get("epochs"),
                "data": rec.get("data") or {"train_tokens": rec.get("train_tokens")},
                "environment": rec.get("environment")}

    def run(self, plan: list[Planned]) -> list[dict]:
        """Every planned run, in order: found, trained, or (held by another process) waited for at the end."""
        done: dict[int, dict] = {}
        busy: list[int] = []
        for i, p in enumerate(plan):
            res = self.obtain(p)
            if res == "busy":
                busy.append(i)
            elif res is not None:
                done[i] = res
        for i in busy:
            while (res := self.obtain(plan[i])) == "busy":
                time.sleep(WAIT_POLL_S)
            if res is not None:
                done[i] = res
        return [done[i] for i in sorted(done)]

    def run_dir_of(self, p: Planned) -> Path:
        """Where ``p`` trains: its older suite folder's directory when that holds its config, else the store's."""
        legacy = _run_dir(self.out, p.row.label, p.seed)
        return legacy if (legacy / CONFIG_FILE).is_file() else self.store.run_dir(run_key(p.run))

    def state(self, p: Planned) -> str:
        """finished | training (another process holds its directory) | interrupted (a directory without a finished
        run) | to_train: :func:`suite_status`."""
        if self.find(p) is not None:
            return "finished"
        run_dir = self.run_dir_of(p)
        no_symlink_below(run_dir.parent.parent, run_dir)
        if not run_dir.is_dir():
            return "to_train"
        return "training" if _locked(run_dir) else "interrupted"

    def obtain(self, p: Planned) -> dict | str | None:
        """The results entry of ``p``: found, or trained now; "busy" when another process is training it;
        None when it is not finished and this call trains nothing."""
        from mhmoe.train.loop import train

        found = self.find(p)
        if found is not None:
            return found
        if not self.train_missing:
            self._say(p, "not finished, left out")
            return None
        legacy = _run_dir(self.out, p.row.label, p.seed)
        run_dir = self.run_dir_of(p)
        if run_dir == legacy:
            _check_same_run(legacy, p.run)
        resume = run_dir.is_dir()
        make_dirs(run_dir, root=run_dir.parent.parent)  # a symlinked row, seed or run directory is refused
        self._say(p, f"{p.run.train.max_steps} steps -> {run_dir}")
        try:
            train(p.run, run_dir, resume=resume, progress=self.progress)
        except ConfigError:
            if _locked(run_dir):
                self._say(p, "being trained by another process; later")
                return "busy"
            found = self.find(p)  # finished by the other process in between
            if found is None:
                raise
            return found
        if run_dir == legacy:
            return self.find(p)
        rec = self.store.write_record(p.run, run_dir, self.environment(), self.data_version(p.run))
        return self.entry(p, rec, run_dir)


def _locked(run_dir: Path) -> bool:
    """Whether another process holds ``run_dir``'s training lock now."""
    from mhmoe.train.lock import RunDirLock

    try:
        with RunDirLock(run_dir, warn=False):
            return False
    except ConfigError:
        return True
