"""virtaccel: the product layer over the VA-1 stack (launcher, images, CLI, suites)."""
from __future__ import annotations
