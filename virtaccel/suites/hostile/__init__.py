"""`virtaccel hostile`: hostile-guest scenarios against every attachment, with verdicts
(docs/hostile.md)."""
from __future__ import annotations

from .core import ATTACHMENTS, Attack, Result, Scenario, Setup, Verdict
from .runner import Report, run_scenario, run_suite

__all__ = ["ATTACHMENTS", "Attack", "Report", "Result", "Scenario", "Setup", "Verdict",
           "run_scenario", "run_suite"]
