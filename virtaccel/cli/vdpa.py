"""`virtaccel vdpa [--image IMAGE] [-j] [-b FILE] OBJECT COMMAND ...`: iproute2's `vdpa`
tool against the host built from a VM image.

The host is launched from the image (default vm_images/vdpa-pci.toml: its VM's vdpa
device open by the VMM, a spare function with a management device only) and, unless
--no-run, the image's guest program runs first, so that features are negotiated and the
queue counters move. Every command then goes as netlink bytes through the "vdpa"
generic netlink family (vmm.vdpa.netlink); a refused one prints the kernel's errno and
extack text. Commands, as iproute2 spells them:

    mgmtdev show [MGMTDEV]
    dev add name NAME mgmtdev MGMTDEV
    dev del NAME
    dev show [NAME]
    dev config show [NAME]
    dev vstats show NAME qidx N

`-b FILE` runs one command per line of FILE ('-': stdin; blank lines and # comments
skipped) on the same host, in order; `-j` prints JSON (iproute2's shapes) instead of text.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from ._args import CliError

DEFAULT_IMAGE = Path(__file__).resolve().parents[2] / "vm_images" / "vdpa-pci.toml"
USAGE = ("mgmtdev show [MGMTDEV] | dev add name NAME mgmtdev MGMTDEV | dev del NAME | "
         "dev show [NAME] | dev config show [NAME] | dev vstats show NAME qidx N")
Attrs = list[tuple[str, Any]]


def _features(mask: int) -> list[str]:
    from hwspec import va1
    from hwspec import virtio as V
    names = {getattr(V, n): n[2:] for n in dir(V) if n.startswith("F_")}
    names.update({getattr(va1, n): "VA1_" + n[2:] for n in dir(va1)
                  if n.startswith("F_") and isinstance(getattr(va1, n), int)})
    return [names.get(b, f"bit_{b}") for b in range(64) if mask >> b & 1]


def _one(attrs: Attrs, key: str) -> Any:
    return dict(attrs).get(f"VDPA_ATTR_{key}")


def _pairs(attrs: Attrs) -> dict[str, int]:
    names = [v for k, v in attrs if k == "VDPA_ATTR_DEV_VENDOR_ATTR_NAME"]
    values = [v for k, v in attrs if k == "VDPA_ATTR_DEV_VENDOR_ATTR_VALUE"]
    return dict(zip(names, values))


def _mgmt_handle(attrs: Attrs) -> str:
    return f"{_one(attrs, 'MGMTDEV_BUS_NAME')}/{_one(attrs, 'MGMTDEV_DEV_NAME')}"


def parse_command(words: list[str]) -> tuple[str, dict[str, Any]]:
    """(what, arguments) of one command line; CliError naming the mistake."""
    def need(n: int) -> None:
        if len(words) < n:
            raise CliError(f"{' '.join(words) or '(empty)'}: incomplete command ({USAGE})")
    need(2)
    obj, cmd, rest = words[0], words[1], words[2:]
    if obj == "mgmtdev" and cmd == "show" and len(rest) <= 1:
        return "mgmtdev show", {"handle": rest[0] if rest else None}
    if obj == "dev":
        if cmd == "add":
            kv = dict(zip(rest[::2], rest[1::2]))
            if len(rest) != 4 or set(kv) != {"name", "mgmtdev"}:
                raise CliError(f"dev add: give 'name NAME mgmtdev MGMTDEV' (got {' '.join(rest)!r})")
            return "dev add", kv
        if cmd == "del" and len(rest) == 1:
            return "dev del", {"name": rest[0]}
        if cmd == "show" and len(rest) <= 1:
            return "dev show", {"name": rest[0] if rest else None}
        if cmd == "config" and rest[:1] == ["show"] and len(rest) <= 2:
            return "dev config show", {"name": rest[1] if len(rest) == 2 else None}
        if cmd == "vstats" and rest[:1] == ["show"]:
            if len(rest) != 4 or rest[2] != "qidx":
                raise CliError("dev vstats show: give 'NAME qidx N'")
            try:
                qidx = int(rest[3], 0)
            except ValueError:
                raise CliError(f"dev vstats show: qidx {rest[3]!r} is not an integer") from None
            if not 0 <= qidx < 1 << 32:
                raise CliError(f"dev vstats show: qidx {qidx} is outside 0 .. 2**32-1")
            return "dev vstats show", {"name": rest[1], "qidx": qidx}
    raise CliError(f"{' '.join(words)}: unknown command ({USAGE})")


def execute(client: Any, what: str, a: dict[str, Any]) -> dict[str, Any]:
    """Run one parsed command; iproute2's JSON object for it."""
    if what == "mgmtdev show":
        out: dict[str, Any] = {}
        for r in client.mgmtdev_show(a["handle"]):
            out[_mgmt_handle(r)] = {
                "supported_classes": ["va1"] if _one(r, "MGMTDEV_SUPPORTED_CLASSES") else [],
                "max_supported_vqs": _one(r, "DEV_MGMTDEV_MAX_VQS"),
                "dev_features": _features(int(_one(r, "DEV_SUPPORTED_FEATURES") or 0))}
        return {"mgmtdev": out}
    if what == "dev add":
        client.dev_add(a["name"], a["mgmtdev"])
        return {}
    if what == "dev del":
        client.dev_del(a["name"])
        return {}
    if what == "dev show":
        return {"dev": {_one(r, "DEV_NAME"): {
            "type": "va1", "mgmtdev": _mgmt_handle(r), "device_id": _one(r, "DEV_ID"),
            "vendor_id": _one(r, "DEV_VENDOR_ID"), "max_vqs": _one(r, "DEV_MAX_VQS"),
            "max_vq_size": _one(r, "DEV_MAX_VQ_SIZE"), "min_vq_size": _one(r, "DEV_MIN_VQ_SIZE")}
            for r in client.dev_show(a["name"])}}
    if what == "dev config show":
        out = {}
        for r in client.dev_config_show(a["name"]):
            cfg: dict[str, Any] = dict(_pairs(r))
            cfg["dev_features"] = _features(int(_one(r, "DEV_FEATURES") or 0))
            neg = _one(r, "DEV_NEGOTIATED_FEATURES")
            if neg is not None:
                cfg["negotiated_features"] = _features(int(neg))
            out[_one(r, "DEV_NAME")] = cfg
        return {"config": out}
    r = client.dev_vstats_show(a["name"], a["qidx"])[0]
    stats: dict[str, Any] = {"queue_index": _one(r, "DEV_QUEUE_INDEX")}
    stats.update(_pairs(r))
    return {"vstats": {_one(r, "DEV_NAME"): stats}}


def _text(doc: dict[str, Any]) -> list[str]:
    """iproute2's plain output: one line per object, 'key value' pairs."""
    lines = []
    for kind, objs in doc.items():
        for name, fields in objs.items():
            parts = [f"{name}:" if kind != "dev" else f"{name}:"]
            for k, v in fields.items():
                v = " ".join(v) if isinstance(v, list) else v
                parts.append(f"{k} {v}")
            lines.append(" ".join(str(p) for p in parts))
    return lines


def _lines(batch: str) -> list[list[str]]:
    try:
        text = sys.stdin.read() if batch == "-" else Path(batch).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"-b {batch}: {e.strerror or e}") from None
    return [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def cli(args: argparse.Namespace) -> int:
    from vmm.vdpa.errors import VdpaError
    from vmm.vdpa.netlink import VdpaClient
    from ..images import ImageError, load_image, resolve_program
    from ..session import Session
    if args.batch is not None and args.command:
        raise CliError("give a command or -b FILE, not both")
    commands = _lines(args.batch) if args.batch is not None else [list(args.command)]
    if not commands or commands == [[]]:
        raise CliError(f"no command ({USAGE})")
    parsed = [parse_command(words) for words in commands]     # every line checked first
    try:
        image = load_image(args.image or DEFAULT_IMAGE)
    except ImageError as e:
        raise CliError(str(e)) from None
    if image.accelerator.mode != "vdpa":
        raise CliError(f"--image {image.path}: mode {image.accelerator.mode!r}, a vdpa "
                       "image (mode = \"vdpa\") is needed")
    with Session.from_image(image) as s:
        if not args.no_run:
            program = resolve_program(image)
            seed = s.seed
            s.run(lambda os_: program(os_, seed=seed, **image.args))
        assert s.host is not None
        client = VdpaClient(s.host.vdpa.genl.socket(admin=True))
        docs: list[dict[str, Any]] = []
        for (what, a), words in zip(parsed, commands):
            try:
                doc = execute(client, what, a)
            except VdpaError as e:
                name = errno.errorcode.get(e.errno or 0, str(e.errno))
                raise CliError(f"{' '.join(words)}: kernel answers {name} "
                               f"({os.strerror(e.errno or 0)}): {e.strerror}") from None
            docs.append(doc)
            if args.json:
                if doc:
                    print(json.dumps(doc))
            else:
                for line in _text(doc):
                    print(line)
    return 0
