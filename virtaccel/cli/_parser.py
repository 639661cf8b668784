"""The `virtaccel` argument parser: every verb's options, and nothing heavy imported.

Each verb names its handler as "module:function" (relative to virtaccel.cli); `main`
imports it only when the verb runs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Sequence

from ..errors import VirtaccelError
from ._args import fraction, integer, seed

HANDLER = "handler"


class ParseExit(VirtaccelError):
    """argparse finished (help, version, or a one-line error already printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`virtaccel <verb>: <message>`) and no sys.exit."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise ParseExit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            print(message.rstrip("\n"), file=sys.stderr)
        raise ParseExit(status)


class _Version(argparse.Action):
    """--version, resolving the installed version only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        from virtaccel import __version__
        print(f"virtaccel {__version__}")
        parser.exit()


def _verb(sub: Any, name: str, handler: str, help: str, prog: str | None = None,
          **kw: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help, **kw)
    p.set_defaults(handler=handler, verb=prog or f"virtaccel {name}")
    return p


def _json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", metavar="FILE", default=None,
                   help=f"write {what} as JSON to FILE ('-': stdout, instead of the tables)")


def _seed(p: argparse.ArgumentParser, default: int | None = 0, extra: str = "") -> None:
    p.add_argument("--seed", type=seed, default=default, metavar="N",
                   help="machine and data seed, 0 .. 2**64-1, decimal or 0x hex "
                        f"(default {default if default is not None else extra})")


def _trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write a Chrome trace-event JSON of the run (open it in Perfetto)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="virtaccel",
                    description="A virtualized AI-accelerator stack (VA-1) in one process.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")

    p = _verb(sub, "demo", ".demo:cli",
              "boot one VM with a VA-1 over virtio-mmio and run a two-layer MLP")
    _seed(p)
    _trace(p)
    _json(p, "the report (per-command device time, error, digest)")

    p = _verb(sub, "vm", "", "VM images: boot one and run its guest program")
    vsub = p.add_subparsers(dest="vm_command", required=True, metavar="ACTION")
    r = _verb(vsub, "run", ".vm:cli_run",
              "boot IMAGE (vm_images/*.toml), run its program (sriov-vf: every tenant "
              "VM's), print the result and the trace digest; exit 1 unless the result is ok",
              prog="virtaccel vm run")
    r.add_argument("image", metavar="IMAGE", help="a VM image file (TOML)")
    _seed(r, None, "the image's")
    r.add_argument("--features", metavar="NAMES", default=None,
                   help="the optional virtio features the guest driver may accept, comma "
                        "separated (indirect, event_idx, packed, in_order, "
                        "notification_data, ring_reset; 'none' for none); overrides the "
                        "image's [guest]")
    r.add_argument("--strict", action="store_true",
                   help="exit 1 if the device logged any violation of a driver rule, and "
                        "print the rules")
    _trace(r)
    _json(r, "the result, MMIO exit counts, violations and the digest")

    p = _verb(sub, "compile", ".compile:cli", "compile an ONNX model to a VA-1 code object")
    p.add_argument("model", help="an .onnx model")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="the .vaelf to write")
    p.add_argument("--scratchpad", type=integer("--scratchpad", 64, (1 << 32) - 1),
                   default=None, metavar="BYTES",
                   help="tile for this scratchpad size in bytes, 64 .. 2**32-1 "
                        "(default: the datasheet's)")
    p.add_argument("--int8", action="store_true",
                   help="quantize GEMMs and convolutions to int8 (needs --calibrate); the "
                        "summary gives the error against f32")
    p.add_argument("--calibrate", default=None, metavar="IN.npz",
                   help=".npz with one array per graph input: its shape (one feed) or "
                        "[N, *shape] (N feeds)")
    p.add_argument("--int8-min-cosine", type=fraction("--int8-min-cosine"), default=None,
                   metavar="C",
                   help="keep the costliest layers in f32 until each calibration feed's "
                        "cosine to f32 is >= C, 0 .. 1 (default 0.998; 0 quantizes every "
                        "layer it can)")
    p.add_argument("--int8-scales", choices=("dynamic", "static"), default=None,
                   help="activation scales: dynamic (default: each tensor's range taken at "
                        "run time by QUANTIZE_DYNAMIC; --calibrate only picks the layers "
                        "kept f32) or static (calibrated ranges)")
    _json(p, "the summary")

    p = _verb(sub, "run", ".run:cli", "run a code object (.vaelf) or an ONNX model in a VM")
    p.add_argument("model", help="a .vaelf code object or a .onnx model (compiled first)")
    p.add_argument("--inputs", required=True, metavar="IN.npz",
                   help=".npz (np.savez) with one array per graph input")
    p.add_argument("--out", required=True, metavar="OUT.npz",
                   help=".npz to write the outputs to")
    p.add_argument("--image", default=None,
                   help="VM image to boot (default: one emulated VA-1 over virtio-mmio)")
    p.add_argument("--function", default="main", help="entry point (default main)")
    _seed(p)
    _trace(p)
    _json(p, "the report (outputs, per-command device time, virtual and wall time)")

    p = _verb(sub, "objdump", ".objdump:cli",
              "show a VA-1 code object: sections, symbols, relocations, metadata, disassembly")
    p.add_argument("file", help="a .vaelf code object")

    p = _verb(sub, "tenants", ".tenants:cli",
              "N tenant VMs on N VFs of one VA-1 card, saturating it: per-VF device time, "
              "completions, p50/p99 latency, correctness; Jain's index")
    p.add_argument("--vfs", type=integer("--vfs", 1, 64), required=True, metavar="N",
                   help="number of VFs (and tenant VMs), 1 .. TotalVFs (64)")
    p.add_argument("--weights", required=True, metavar="W1,W2,...",
                   help="one scheduling weight (>= 1) per VF, comma-separated")
    p.add_argument("--aggressor", type=integer("--aggressor", -(1 << 31), 1 << 31),
                   default=None, metavar="K",
                   help="VF K floods its queues; the others run closed-loop and their p99 "
                        "is compared with a run without the aggressor")
    _seed(p)
    p.add_argument("--duration-us", type=integer("--duration-us", 1, 10**7), default=None,
                   metavar="US", help="virtual time each tenant submits for (default: "
                                      "enough for every tenant to overlap, growing with N)")
    _json(p, "the per-VF results")

    p = _verb(sub, "hostile", ".hostile:cli",
              "hostile-guest scenarios (rings, registers, config space, commands, VFIO, vDPA) "
              "against each attachment while a victim works; a verdict per scenario; exit 1 "
              "on any WEDGED or FAIL")
    p.add_argument("--attach", default=None, metavar="A[,A...]",
                   help="attachments to attack: mmio, pci, vfio, sriov, vdpa (default all)")
    p.add_argument("--category", default=None, metavar="C[,C...]",
                   help="only these categories (see docs/hostile.md), comma-separated")
    p.add_argument("--scenario", default=None, metavar="PREFIX[,...]",
                   help="only scenarios whose name starts with one of these")
    _seed(p)
    _json(p, "every scenario's verdict")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="write a self-contained HTML report to FILE")
    p.add_argument("--self-test", action="store_true",
                   help="prove the suite can fail: break the device in each known way "
                        "(device_model.testing_breaks) and check some scenario turns FAIL "
                        "or WEDGED (with --attach: on each attachment a breakage applies to)")

    p = _verb(sub, "explore", ".explore:cli",
              "run IMAGE over many seeds (with fault plans), check the invariants, and "
              "shrink every failure to a minimal fault plan that replays it; exit 1 on any "
              "failure")
    p.add_argument("image", metavar="IMAGE", help="a VM image file (TOML)")
    p.add_argument("--seeds", required=True, metavar="A:B",
                   help="the seeds A, A+1, .. B-1 (A < B, each 0 .. 2**64-1)")
    p.add_argument("--faults", metavar="PLAN.toml", default=None,
                   help="a fault plan ([[faults]] tables) for every seed, instead of the "
                        "image's own")
    p.add_argument("--random-faults", type=integer("--random-faults", 0, 64), default=0,
                   metavar="N", help="add N faults drawn per seed from a seeded generator "
                                     "(default 0)")
    p.add_argument("--jobs", type=integer("--jobs", 1, 1024), default=None, metavar="N",
                   help="local worker processes (default: the CPUs); the report is the same "
                        "whatever N")
    p.add_argument("--cluster", metavar="ADDRESS", default=None,
                   help="run the seeds on this Dask scheduler (tcp://host:8786) instead of "
                        "local processes (needs the 'cluster' extra)")
    p.add_argument("--break", dest="breaks", metavar="NAME[,NAME]", default=None,
                   help="boot every guest with its driver's recovery broken on purpose "
                        "(va1.break=NAME; docs/faults.md): recovery/no-lost-irq-poll, "
                        "recovery/no-watchdog, recovery/no-abort-on-reset")
    p.add_argument("--wait-bound-ns", type=integer("--wait-bound-ns", 1, (1 << 63) - 1),
                   default=None, metavar="NS",
                   help="a guest wait longer than this breaks an invariant (default 5 s)")
    p.add_argument("--time-limit-ns", type=integer("--time-limit-ns", 1, (1 << 63) - 1),
                   default=None, metavar="NS",
                   help="end each run's guest waits at this virtual time (default 20 s; "
                        "must exceed the wait bound)")
    p.add_argument("--shrink", type=integer("--shrink", 0, 1 << 30), default=None,
                   metavar="N", help="shrink only the first N failing seeds to a minimal "
                                     "plan (default: every one)")
    p.add_argument("--plans", metavar="DIR", default=None,
                   help="write each failing seed's minimal plan to DIR/seed-<N>.toml")
    _json(p, "the report")

    p = _verb(sub, "vdpa", ".vdpa:cli",
              "iproute2's vdpa tool (mgmtdev show; dev add/del/show; dev config show; dev "
              "vstats show) over the vdpa netlink family of a host built from a vdpa image")
    p.add_argument("--image", default=None, metavar="IMAGE",
                   help="a vdpa VM image (default vm_images/vdpa-pci.toml)")
    p.add_argument("-j", dest="json", action="store_true",
                   help="print JSON (one object per command, iproute2's shapes)")
    p.add_argument("-b", "--batch", metavar="FILE", default=None,
                   help="run one command per line of FILE ('-': stdin) on the same host")
    p.add_argument("--no-run", action="store_true",
                   help="do not run the image's guest program before the commands")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="OBJECT COMMAND",
                   help="mgmtdev show [MGMTDEV] | dev add name NAME mgmtdev MGMTDEV | dev del "
                        "NAME | dev show [NAME] | dev config show [NAME] | dev vstats show "
                        "NAME qidx N")

    p = _verb(sub, "stats", ".stats:cli",
              "run the demo workload and print per-function and per-context counters")
    _seed(p)
    _json(p, "the counters")

    p = _verb(sub, "bench", ".bench:cli",
              "benchmarks: ratios against numpy / copyto / a bare ring / python -c pass")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the rows as JSON to FILE ('-': stdout), and the figure as "
                        "FILE's .png beside it")
    p.add_argument("--only", metavar="CASES", default="",
                   help="comma-separated cases to run (default all; see docs/benchmarks.md)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes: checks the machinery, the numbers mean nothing")
    p.add_argument("--no-profile", action="store_true",
                   help="do not profile rows that miss their target")
    p.add_argument("--blas-threads", metavar="N", type=int, default=None,
                   help="BLAS threads for the stack and every baseline alike (default 1; "
                        "0: the library's default)")
    return parser
