"""Submissions' buffers through port views (ring.DmaWindow): with views a submission's
request, command buffer and response take no DMA call; without views, under another
view epoch or outside what the port will view, the DMA calls and their faults are the
ones made without windows."""
from __future__ import annotations

import pytest
from dm_driver import Rig, nop

from device_model.ports import DmaFault
from device_model.virtio.ring import Descriptor, DescriptorChain, DmaWindow
from hwspec.va1 import NO_OFFSET, Status


def _accesses(views: bool) -> tuple[Rig, int, list[tuple[str, int, int]]]:
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0 if views else None
    cid = rig.create_context()
    cmd = rig.put(nop())
    rig.dma.log.clear()
    r = rig.submit(cid, b"", fence=7, addr=cmd, length=8)
    assert (r.status, r.error_offset, r.fence) == (Status.OK, NO_OFFSET, 7)
    return rig, cmd, list(rig.dma.log)


def test_a_submission_through_views_makes_no_dma_call() -> None:
    _, _, log = _accesses(views=True)
    assert log == []


def test_without_views_every_buffer_is_a_dma_call() -> None:
    _, cmd, log = _accesses(views=False)
    kinds = [k for k, _, _ in log]
    assert ("read", cmd, 8) in log                      # the command buffer
    assert kinds.count("read") > 2 and ("view" in kinds) and ("write" in kinds)


@pytest.mark.parametrize("views", [False, True])
def test_a_command_buffer_outside_ram_faults_the_same(views: bool) -> None:
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0 if views else None
    cid = rig.create_context()
    r = rig.submit(cid, b"", fence=3, addr=0x1000, length=8)
    assert (r.status, r.error_offset, r.fence) == (Status.DMA_FAULT, NO_OFFSET, 3)
    assert ("read", 0x1000, 8) in rig.dma.log            # the DMA call that faulted


def test_a_new_view_epoch_sends_the_response_through_the_dma_checks() -> None:
    """The response buffer is unmapped (and the epoch moved, as a port does) between the
    walk and the completion: the reply takes the DMA call, which faults (ring/dma)."""
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0
    cid = rig.create_context()
    resp = rig.submit_nowait(cid, nop(), fence=4)
    rig.kick()
    rig.dma.holes.append((resp, resp + 32))
    rig.dma.view_epoch = 1
    rig.clock.run()
    assert ("view", resp, 32) in rig.dma.log
    assert rig.mmio.violations[-1].rule == "ring/dma"
    assert rig.dma.g_read(resp, 32) == bytes(32)


def test_a_window_is_only_what_the_port_views() -> None:
    """A window never covers a range the port refuses to view: the DMA call is made
    (and raises the port's fault); inside the window the bytes are the port's."""
    rig = Rig(qsize=8)
    dma = rig.dma
    w = DmaWindow()
    assert not w.cover(dma, dma.base, 16)                # no view_epoch: no views
    dma.view_epoch = 5
    dma.holes.append((dma.base + 0x1000, dma.base + 0x2000))
    assert not w.cover(dma, dma.base + 0x1800, 16)
    assert w.cover(dma, dma.base + 0x3000, 16)
    assert (w.lo, w.hi, w.epoch) == (dma.base + 0x3000, dma.base + 0x3010, 5)  # exact
    assert w.cover(dma, dma.base + (4 << 20) + 8, 16)    # the 2 MiB around it
    assert (w.lo, w.hi) == (dma.base + (4 << 20), dma.base + (6 << 20))
    dma.g_write(dma.base + 0x1800, b"x" * 16)
    chain = DescriptorChain(0, [Descriptor(dma.base + 0x1800, 16, False)],
                            [Descriptor(dma.base + 0x1800, 16, True)])
    with pytest.raises(DmaFault, match="unmapped"):
        chain.read(dma, 16, w)
    with pytest.raises(DmaFault, match="unmapped"):
        chain.write(dma, b"y" * 16, w)
    dma.holes.clear()
    at = dma.base + (4 << 20) + 64
    dma.g_write(at, b"abcd")
    inside = DescriptorChain(0, [Descriptor(at, 4, False)], [Descriptor(at, 4, True)])
    dma.log.clear()
    assert inside.read(dma, 16, w) == b"abcd"
    assert inside.write(dma, b"wxyz", w) == 4
    assert dma.log == [] and dma.g_read(at, 4) == b"wxyz"


def test_window_under_a_read_only_iommu_mapping_takes_the_dma_call() -> None:
    """Behind an IOMMU a window needs a readable and writable mapping: a buffer in a
    read-only one is read by the DMA call (allowed) and its write faults as before."""
    from vmm.iommu import PAGE_SIZE, Iommu, IommuDma, bdf
    from vmm.memory import GuestMemory, HostMemory

    host = HostMemory(4 * PAGE_SIZE)
    ram = GuestMemory(host, 0x4000_0000, 4 * PAGE_SIZE)
    iommu = Iommu()
    rid = bdf(0, 3, 0)
    domain = iommu.create_domain()
    iommu.attach(rid, domain)
    iommu.map(domain, 0x10_0000, ram, 0x4000_0000, PAGE_SIZE, write=False)
    iommu.map(domain, 0x10_1000, ram, 0x4000_1000, PAGE_SIZE)
    dma = IommuDma(iommu, rid)
    ram.write(0x4000_0000, b"ro!!")
    w = DmaWindow()
    chain = DescriptorChain(0, [Descriptor(0x10_0000, 4, False)],
                            [Descriptor(0x10_0000, 4, True)])
    assert chain.read(dma, 4, w) == b"ro!!" and dma.bytes_read == 4
    with pytest.raises(DmaFault, match="write permission"):
        chain.write(dma, b"nope", w)
    assert ram.read(0x4000_0000, 4) == b"ro!!"
    rw = DescriptorChain(0, [], [Descriptor(0x10_1000, 4, True)])
    assert rw.write(dma, b"rw!!", w) == 4 and dma.bytes_written == 0   # through the view
    assert ram.read(0x4000_1000, 4) == b"rw!!"
    host.close()
