"""The run records committed under docs/results/*-runs/ keep their keys under the current code: a config field
added with a default must not change the identity of runs that were trained before it existed
(``mhmoe.research.store.ADDED_FIELDS``), or every finished run of a suite would be trained again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mhmoe.config.run import RunConfig
from mhmoe.research.store import identity, run_key

ROOT = Path(__file__).resolve().parents[2]
RECORDS = sorted(ROOT.glob("docs/results/*-runs/*.json"))


@pytest.mark.skipif(not RECORDS, reason="no committed run records")
def test_every_committed_record_keeps_its_key_and_identity():
    moved = []
    for path in RECORDS:
        rec = json.loads(path.read_text(encoding="utf-8"))
        run = RunConfig.from_dict(rec["config"])
        if run_key(run) != path.stem or identity(run) != rec["identity"]:
            extra = sorted(set(identity(run)) - set(rec["identity"]))
            moved.append(f"{path.name}: fields not in the record's identity: {extra}")
    assert not moved, f"{len(moved)} of {len(RECORDS)} records moved; first: {moved[0]}"
