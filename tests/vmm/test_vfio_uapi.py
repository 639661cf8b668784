"""vmm.vfio.uapi against the installed linux/vfio.h, compiled with the C compiler."""
import os

import pytest

from header_probe import c_compiler, run_probe

from vmm.vfio import uapi

HEADER = "/usr/include/linux/vfio.h"

CONSTANTS = sorted(n for n in dir(uapi) if n.startswith("VFIO_") and isinstance(getattr(uapi, n), int))
STRINGS = sorted(n for n in dir(uapi) if n.startswith("VFIO_") and isinstance(getattr(uapi, n), str))
IOC_CONSTANTS = ["IOC_NRBITS", "IOC_TYPEBITS", "IOC_SIZEBITS", "IOC_DIRBITS", "IOC_NRSHIFT",
                 "IOC_TYPESHIFT", "IOC_SIZESHIFT", "IOC_DIRSHIFT", "IOC_NONE", "IOC_WRITE", "IOC_READ"]
# the helpers encode size and direction, which no VFIO ioctl uses: check them on made-up ones
IOC_SAMPLES = [("_IOR", 200, "vfio_region_info"), ("_IOW", 201, "vfio_iommu_type1_dma_map"),
               ("_IOWR", 202, "vfio_irq_set"), ("_IOR", 7, "vfio_group_status")]


def _fields(struct):
    return [(name, _flexible(f)) for name, f in uapi.ffi.typeof(f"struct {struct}").fields]


def _flexible(field):
    return field.type.kind == "array" and field.type.length is None


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """{key: value} printed by a C program built against the installed header."""
    if not os.path.exists(HEADER):
        pytest.skip(f"{HEADER} is not installed: nothing to compare with")
    c_compiler()
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/ioctl.h>",
             "#include <linux/vfio.h>", "int main(void) {"]
    for n in CONSTANTS:
        lines.append(f'  printf("const {n} %llu\\n", (unsigned long long)({n}));')
    for n in STRINGS:
        lines.append(f'  printf("str {n} %s\\n", {n});')
    for n in IOC_CONSTANTS:
        lines.append(f'  printf("ioc {n} %llu\\n", (unsigned long long)(_{n}));')
    for macro, nr, struct in IOC_SAMPLES:
        lines.append(f'  printf("sample {macro} {nr} {struct} %llu\\n", '
                     f'(unsigned long long){macro}(VFIO_TYPE, {nr}, struct {struct}));')
    for s in uapi.STRUCTS:
        lines.append(f'  printf("sizeof {s} %zu\\n", sizeof(struct {s}));')
        for f, flexible in _fields(s):
            lines.append(f'  printf("offsetof {s} {f} %zu\\n", offsetof(struct {s}, {f}));')
            if not flexible:
                    lines.append(f'  printf("fieldsize {s} {f} %zu\\n", '
                             f'sizeof(((struct {s} *)0)->{f}));')
    lines += ["  return 0;", "}"]
    return run_probe(lines, tmp_path_factory.mktemp("vfio_h"), HEADER)


@pytest.mark.parametrize("name", CONSTANTS)
def test_constant_matches_header(kernel, name):
    assert getattr(uapi, name) == int(kernel[f"const {name}"]), name


@pytest.mark.parametrize("name", STRINGS)
def test_string_matches_header(kernel, name):
    assert getattr(uapi, name) == kernel[f"str {name}"]


@pytest.mark.parametrize("name", IOC_CONSTANTS)
def test_ioctl_encoding_constant_matches_header(kernel, name):
    assert getattr(uapi, name) == int(kernel[f"ioc {name}"])


@pytest.mark.parametrize("macro,nr,struct", IOC_SAMPLES)
def test_ioctl_helpers_encode_like_the_c_macros(kernel, macro, nr, struct):
    ours = getattr(uapi, macro)(uapi.VFIO_TYPE, nr, uapi.ffi.sizeof(f"struct {struct}"))
    assert ours == int(kernel[f"sample {macro} {nr} {struct}"])


@pytest.mark.parametrize("struct", uapi.STRUCTS)
def test_struct_layout_matches_header(kernel, struct):
    ffi = uapi.ffi
    assert ffi.sizeof(f"struct {struct}") == int(kernel[f"sizeof {struct}"]), "sizeof"
    for name, field in ffi.typeof(f"struct {struct}").fields:
        assert field.offset == int(kernel[f"offsetof {struct} {name}"]), f"offsetof {name}"
        if _flexible(field):
            continue  # a flexible array member has no size in C
        assert ffi.sizeof(field.type) == int(kernel[f"fieldsize {struct} {name}"]), f"sizeof {name}"


def test_every_ioctl_we_need_is_named():
    needed = {"VFIO_GET_API_VERSION", "VFIO_CHECK_EXTENSION", "VFIO_SET_IOMMU", "VFIO_GROUP_GET_STATUS",
              "VFIO_GROUP_SET_CONTAINER", "VFIO_GROUP_UNSET_CONTAINER", "VFIO_GROUP_GET_DEVICE_FD",
              "VFIO_DEVICE_GET_INFO", "VFIO_DEVICE_GET_REGION_INFO", "VFIO_DEVICE_GET_IRQ_INFO",
              "VFIO_DEVICE_SET_IRQS", "VFIO_DEVICE_RESET", "VFIO_IOMMU_GET_INFO",
              "VFIO_IOMMU_MAP_DMA", "VFIO_IOMMU_UNMAP_DMA"}
    assert set(uapi.IOCTL_NAMES.values()) == needed
    assert len(uapi.IOCTL_NAMES) == len(needed)  # all distinct


def test_new_sets_argsz_and_sizes_flexible_arrays():
    p = uapi.new("struct vfio_irq_set *", {"data": 8})
    assert p.argsz == uapi.ffi.sizeof("struct vfio_irq_set") + 8 == uapi.argsz(p)
    m = uapi.new("struct vfio_iommu_type1_dma_map *")
    assert m.argsz == uapi.ffi.sizeof("struct vfio_iommu_type1_dma_map")
    assert uapi.offsetofend("vfio_iommu_type1_dma_map", "size") == m.argsz


def test_ioc_rejects_fields_out_of_range():
    with pytest.raises(ValueError):
        uapi._IOR(uapi.VFIO_TYPE, 256, 4)
    with pytest.raises(ValueError):
        uapi._IOW(uapi.VFIO_TYPE, 1, 1 << 14)
