"""`python -m virtaccel.cli`: the same entry point as the `virtaccel` script."""
import sys

from . import main

sys.exit(main())
