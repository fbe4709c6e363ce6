"""``python -m mhmoe.moe.dispatch.native``: build the C++ CPU expert loop ahead of time."""

import sys

from mhmoe.moe.dispatch.native import main

sys.exit(main())
