"""Deliberate breakages of the guest driver's recovery, for proving the checkers can fail.

`virtaccel explore --break NAME` (docs/faults.md, "A broken driver on purpose") boots
every guest with `va1.break=NAME` on its kernel command line; the driver then skips one
piece of its recovery, and a campaign with faults must report the seeds where a fence is
lost or a wait hangs, each with a minimal plan that replays it. Nothing here is on unless
a command line names it.
"""
from __future__ import annotations

KNOWN: dict[str, str] = {
    "recovery/no-lost-irq-poll": "the recovery timer never polls the used rings for "
                                 "completions whose interrupt was lost",
    "recovery/no-watchdog": "the submission watchdog never fires: a submit queue that makes "
                            "no progress is never reset",
    "recovery/no-abort-on-reset": "after a reset, submissions in flight are dropped instead "
                                  "of completing ABORTED (their fences never signal)",
}
