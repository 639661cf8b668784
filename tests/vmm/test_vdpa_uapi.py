"""vmm.vdpa.uapi against the installed linux/vhost.h, linux/vhost_types.h and
linux/vdpa.h, compiled with the C compiler: every constant (ioctl numbers included),
every enum value of the vdpa family and every struct layout the project uses."""
from __future__ import annotations

import os
from typing import Any

import pytest

from header_probe import c_compiler, run_probe

from vmm.vdpa import uapi

HEADERS = ("/usr/include/linux/vhost.h", "/usr/include/linux/vdpa.h")
# newer than some installed headers (Linux 6.3): checked where the header has them
NEWER = {"VHOST_VDPA_RESUME", "VHOST_BACKEND_F_RESUME"}

MACROS = sorted(n for n in dir(uapi) if n.startswith(("VHOST_", "VDPA_GENL_VERSION"))
                and isinstance(getattr(uapi, n), int))
ENUMS = sorted(set(uapi.VDPA_ATTRS) | set(uapi.COMMANDS) | {"VDPA_ATTR_PAD", "VDPA_ATTR_MAX"})


def _ours(name: str) -> int:
    if name in uapi.VDPA_ATTR:
        return uapi.VDPA_ATTR[name]
    if name in uapi.COMMANDS:
        return uapi.COMMANDS.index(name)
    value: int = getattr(uapi, name)
    return value


def _fields(struct: str) -> list[tuple[str, bool]]:
    return [(n, f.type.kind == "array" and f.type.length is None)
            for n, f in uapi.ffi.typeof(f"struct {struct}").fields]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: Any) -> dict[str, str]:
    missing = [h for h in HEADERS if not os.path.exists(h)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: nothing to compare with")
    c_compiler()
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/vhost.h>",
             "#include <linux/vdpa.h>", "int main(void) {"]
    for n in MACROS:
        lines += [f"#ifdef {n}",
                  f'  printf("const {n} %lld\\n", (long long)({n}));',
                  "#else", f'  printf("missing {n} -\\n");', "#endif"]
    for n in ENUMS:
        lines.append(f'  printf("const {n} %lld\\n", (long long)({n}));')
    lines.append('  printf("str VDPA_GENL_NAME %s\\n", VDPA_GENL_NAME);')
    for s in uapi.STRUCTS:
        lines.append(f'  printf("sizeof {s} %zu\\n", sizeof(struct {s}));')
        for f, flexible in _fields(s):
            lines.append(f'  printf("offsetof {s} {f} %zu\\n", offsetof(struct {s}, {f}));')
            if not flexible:
                lines.append(f'  printf("fieldsize {s} {f} %zu\\n", '
                             f'sizeof(((struct {s} *)0)->{f}));')
    lines += ["  return 0;", "}"]
    return run_probe(lines, tmp_path_factory.mktemp("vhost_h"), HEADERS)


@pytest.mark.parametrize("name", MACROS)
def test_constant_matches_header(kernel: dict[str, str], name: str) -> None:
    if f"missing {name}" in kernel:
        assert name in NEWER, f"{name} is not in the installed headers"
        pytest.skip(f"{name} is newer than the installed headers (Linux 6.3)")
    assert _ours(name) == int(kernel[f"const {name}"]), name


@pytest.mark.parametrize("name", ENUMS)
def test_vdpa_enum_matches_header(kernel: dict[str, str], name: str) -> None:
    assert _ours(name) == int(kernel[f"const {name}"]), name


def test_family_name_matches_header(kernel: dict[str, str]) -> None:
    assert uapi.VDPA_GENL_NAME == kernel["str VDPA_GENL_NAME"]


@pytest.mark.parametrize("struct", uapi.STRUCTS)
def test_struct_layout_matches_header(kernel: dict[str, str], struct: str) -> None:
    ffi = uapi.ffi
    assert ffi.sizeof(f"struct {struct}") == int(kernel[f"sizeof {struct}"]), "sizeof"
    for name, field in ffi.typeof(f"struct {struct}").fields:
        assert field.offset == int(kernel[f"offsetof {struct} {name}"]), f"offsetof {name}"
        if field.type.kind == "array" and field.type.length is None:
            continue
        assert ffi.sizeof(field.type) == int(kernel[f"fieldsize {struct} {name}"]), name


def test_every_ioctl_is_named_once() -> None:
    assert len(set(uapi.IOCTL_NAMES)) == len(uapi.IOCTLS)
    assert set(uapi.IOCTL_NAMES.values()) == set(uapi.IOCTLS)
