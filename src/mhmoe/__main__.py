import sys

from mhmoe.cli import main

sys.exit(main())
