#!/usr/bin/env python
"""Regenerate the shipped offline lm-eval tasks (src/mhmoe/integrations/tasks/) from the KJV held-out split.

    python scripts/make_lmeval_tasks.py                       # = mhmoe make-tasks src/mhmoe/integrations/tasks --force
    python scripts/make_lmeval_tasks.py OUT_DIR [--absolute]  # = mhmoe make-tasks OUT_DIR [--absolute]
"""

import sys
from pathlib import Path

from mhmoe.cli import main

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "mhmoe" / "integrations" / "tasks"

if __name__ == "__main__":
    sys.exit(main(["make-tasks", *(sys.argv[1:] or [str(SHIPPED), "--force"])]))
