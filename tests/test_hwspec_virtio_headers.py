"""hwspec's virtio numbers for the packed ring and the issue-13 features against the
installed linux/virtio_ring.h, virtio_config.h, virtio_pci.h and virtio_mmio.h,
compiled with the C compiler (the VFIO header test's pattern). A constant an older
header does not define is skipped by name, with the reason."""
import os
from struct import calcsize

import pytest

from header_probe import c_compiler, run_probe

from hwspec import virtio as V
from hwspec import virtio_mmio as R
from hwspec import virtio_pci as VP

HEADERS = ("linux/virtio_ring.h", "linux/virtio_config.h", "linux/virtio_pci.h",
           "linux/virtio_mmio.h")

# header name -> hwspec value
CONSTANTS = {
    "VRING_DESC_F_NEXT": V.DESC_F_NEXT,
    "VRING_DESC_F_WRITE": V.DESC_F_WRITE,
    "VRING_DESC_F_INDIRECT": V.DESC_F_INDIRECT,
    "VRING_PACKED_DESC_F_AVAIL": V.PACKED_DESC_F_AVAIL,
    "VRING_PACKED_DESC_F_USED": V.PACKED_DESC_F_USED,
    "VRING_PACKED_EVENT_FLAG_ENABLE": V.PACKED_EVENT_FLAG_ENABLE,
    "VRING_PACKED_EVENT_FLAG_DISABLE": V.PACKED_EVENT_FLAG_DISABLE,
    "VRING_PACKED_EVENT_FLAG_DESC": V.PACKED_EVENT_FLAG_DESC,
    "VRING_PACKED_EVENT_F_WRAP_CTR": V.PACKED_EVENT_F_WRAP_CTR,
    "VIRTIO_RING_F_INDIRECT_DESC": V.F_RING_INDIRECT_DESC,
    "VIRTIO_RING_F_EVENT_IDX": V.F_RING_EVENT_IDX,
    "VIRTIO_F_VERSION_1": V.F_VERSION_1,
    "VIRTIO_F_ACCESS_PLATFORM": V.F_ACCESS_PLATFORM,
    "VIRTIO_F_RING_PACKED": V.F_RING_PACKED,
    "VIRTIO_F_IN_ORDER": V.F_IN_ORDER,
    "VIRTIO_F_ORDER_PLATFORM": V.F_ORDER_PLATFORM,
    "VIRTIO_F_SR_IOV": V.F_SR_IOV,
    "VIRTIO_F_NOTIFICATION_DATA": V.F_NOTIFICATION_DATA,
    "VIRTIO_F_NOTIF_CONFIG_DATA": V.F_NOTIF_CONFIG_DATA,
    "VIRTIO_F_RING_RESET": V.F_RING_RESET,
    "VIRTIO_F_ADMIN_VQ": V.F_ADMIN_VQ,
    "VIRTIO_PCI_COMMON_Q_NDATA": VP.COMMON_Q_NDATA,
    "VIRTIO_PCI_COMMON_Q_RESET": VP.COMMON_Q_RESET,
    "VIRTIO_MMIO_QUEUE_NOTIFY": R.QUEUE_NOTIFY,
    "VIRTIO_MMIO_QUEUE_RESET": R.QUEUE_RESET,
}
STRUCTS = {"vring_packed_desc": V.PACKED_DESC, "vring_packed_desc_event": V.PACKED_EVENT,
           "vring_desc": V.DESC, "vring_used_elem": V.USED_ELEM}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """{key: value} printed by a C program built against the installed headers."""
    missing = [h for h in HEADERS if not os.path.exists(f"/usr/include/{h}")]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: nothing to compare with")
    c_compiler()
    lines = ["#include <stdio.h>", "#include <stddef.h>"]
    lines += [f"#include <{h}>" for h in HEADERS]
    lines.append("int main(void) {")
    for n in CONSTANTS:
        lines += [f"#ifdef {n}",
                  f'  printf("const {n} %llu\\n", (unsigned long long)({n}));', "#endif"]
    for s, layout in STRUCTS.items():
        lines.append(f'  printf("sizeof {s} %zu\\n", sizeof(struct {s}));')
        for f in layout.names:
            lines.append(f'  printf("offsetof {s} {f} %zu\\n", offsetof(struct {s}, {f}));')
            lines.append(f'  printf("fieldsize {s} {f} %zu\\n", '
                         f'sizeof(((struct {s} *)0)->{f}));')
    lines += ["  return 0;", "}"]
    values = run_probe(lines, tmp_path_factory.mktemp("virtio_h"), "the virtio headers")
    return {k: int(v) for k, v in values.items()}


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_constant_matches_header(kernel, name):
    key = f"const {name}"
    if key not in kernel:
        pytest.skip(f"{name} is not defined by the installed headers (older kernel headers)")
    assert CONSTANTS[name] == kernel[key], name


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_struct_layout_matches_header(kernel, struct):
    layout = STRUCTS[struct]
    assert layout.size == kernel[f"sizeof {struct}"], "sizeof"
    for name in layout.names:
        assert layout.offsets[name] == kernel[f"offsetof {struct} {name}"], f"offsetof {name}"
        width = calcsize("<" + dict(layout.fields)[name])
        assert width == kernel[f"fieldsize {struct} {name}"], f"sizeof {name}"


def test_flag_masks_follow_the_bit_numbers():
    assert V.DESC_F_AVAIL == 1 << V.PACKED_DESC_F_AVAIL == 0x80
    assert V.DESC_F_USED == 1 << V.PACKED_DESC_F_USED == 0x8000
    assert V.packed_ring_size(3) == 3 * 16
