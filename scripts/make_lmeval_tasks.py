#!/usr/bin/env python
"""Regenerate the shipped offline lm-eval tasks (src/mhmoe/integrations/tasks/) from the KJV held-out split.

    python scripts/make_lmeval_tasks.py [OUT_DIR] [--absolute]      # same as `mhmoe make-tasks`
"""

import sys

from mhmoe.cli import main

if __name__ == "__main__":
    sys.exit(main(["make-tasks", *sys.argv[1:]]))
