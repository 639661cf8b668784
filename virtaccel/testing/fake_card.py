"""A stand-in SR-IOV card for host-side tests: a VA-1 PF with an SR-IOV capability whose
VFs are independent single-function VA-1 devices, and a PF "driver" that provisions them
by hand instead of through an admin queue.

Why: the host's SR-IOV platform, VF BAR decoding, VFIO binding of VFs and VM images can
be tested before (and independently of) the real card (device_model.va1.card) and the
real PF driver (guest_driver.va1.pf). Nothing here shares compute units across VFs, so
fairness and isolation are only meaningful on the real card.
"""
from __future__ import annotations

from typing import Any, Callable

from device_model import DevicePorts, Va1Config, Va1Device, VirtioPciFunction
from device_model.pci.api import BarInfo, MsixInfo, PciFunction
from device_model.ports import MsiPort
from hwspec import pci as P
from hwspec import va1 as A
from hwspec.va1 import VfResources

from vmm.sriov import HostSriovPlatform, SriovError

CAP = P.EXT_CAP_START


class _Delegate:
    """A PciFunction that forwards to `inner` (swappable)."""

    inner: VirtioPciFunction

    def config_read(self, offset: int, size: int) -> int:
        return self.inner.config_read(offset, size)

    def config_write(self, offset: int, size: int, value: int) -> None:
        self.inner.config_write(offset, size, value)

    def bars(self) -> tuple[BarInfo, ...]:
        return self.inner.bars()

    def bar_read(self, index: int, offset: int, size: int) -> int:
        return self.inner.bar_read(index, offset, size)

    def bar_write(self, index: int, offset: int, size: int, value: int) -> None:
        self.inner.bar_write(index, offset, size, value)

    def msix_info(self) -> MsixInfo | None:
        return self.inner.msix_info()

    def function_level_reset(self) -> None:
        self.inner.function_level_reset()

    @property
    def device(self) -> Va1Device:
        return self.inner.device  # type: ignore[return-value]


class FakeVf(_Delegate):
    """A VF: a VirtioPciFunction whose BAR registers read 0 (SR-IOV VFs' do)."""

    def __init__(self, inner: VirtioPciFunction) -> None:
        self.inner = inner

    def config_read(self, offset: int, size: int) -> int:
        if P.BASE_ADDRESS_0 <= offset < P.BASE_ADDRESS_0 + 4 * P.NUM_BARS:
            return 0
        return self.inner.config_read(offset, size)

    def config_write(self, offset: int, size: int, value: int) -> None:
        if P.BASE_ADDRESS_0 <= offset < P.BASE_ADDRESS_0 + 4 * P.NUM_BARS:
            return
        self.inner.config_write(offset, size, value)


class FakeSriovPf(_Delegate):
    """The PF: a VirtioPciFunction plus an SR-IOV extended capability at 0x100."""

    def __init__(self, card: "FakeSriovCard", inner: VirtioPciFunction) -> None:
        self.card = card
        self.inner = inner
        self.regs = bytearray(P.EXT_CAP_SRIOV_SIZEOF)
        self._vf_bar_lo = 0
        self._vf_bar_hi = 0
        self._reset_cap()

    def _reset_cap(self) -> None:
        r = self.regs
        r[:] = bytes(len(r))
        r[0:4] = P.ext_cap_header(P.EXT_CAP_ID_SRIOV, 1, 0).to_bytes(4, "little")
        total = self.card.total_vfs
        for off, size, val in ((P.SRIOV_INITIAL_VF, 2, total), (P.SRIOV_TOTAL_VF, 2, total),
                               (P.SRIOV_VF_OFFSET, 2, A.SRIOV_FIRST_VF_OFFSET),
                               (P.SRIOV_VF_STRIDE, 2, A.SRIOV_VF_STRIDE),
                               (P.SRIOV_VF_DID, 2, A.SRIOV_VF_DEVICE_ID),
                               (P.SRIOV_SUP_PGSIZE, 4, 1), (P.SRIOV_SYS_PGSIZE, 4, 1)):
            r[off:off + size] = val.to_bytes(size, "little")
        self._vf_bar_lo = P.BASE_ADDRESS_MEM_TYPE_64
        self._vf_bar_hi = 0

    def _get(self, off: int, size: int) -> int:
        if off == P.SRIOV_BAR:
            v = self._vf_bar_lo
        elif off == P.SRIOV_BAR + 4:
            v = self._vf_bar_hi
        elif P.SRIOV_BAR < off < P.SRIOV_BAR + 24:
            v = 0
        else:
            return int.from_bytes(self.regs[off:off + size], "little")
        return v & ((1 << (8 * size)) - 1)

    def config_read(self, offset: int, size: int) -> int:
        if CAP <= offset < CAP + P.EXT_CAP_SRIOV_SIZEOF:
            return self._get(offset - CAP, size)
        if offset >= CAP:
            return 0
        return self.inner.config_read(offset, size)

    def config_write(self, offset: int, size: int, value: int) -> None:
        if not CAP <= offset < CAP + P.EXT_CAP_SRIOV_SIZEOF:
            if offset < CAP:
                self.inner.config_write(offset, size, value)
            return
        off = offset - CAP
        if off == P.SRIOV_CTRL and size in (2, 4):
            self.card.set_ctrl(value & (P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE))
        elif off == P.SRIOV_NUM_VF and size == 2:
            self.card.set_num_vfs(value)
        elif off == P.SRIOV_BAR and size == 4:
            mask = ~(A.PCI_BAR_SIZE - 1) & 0xFFFF_FFF0
            self._vf_bar_lo = (value & mask) | P.BASE_ADDRESS_MEM_TYPE_64
        elif off == P.SRIOV_BAR + 4 and size == 4:
            self._vf_bar_hi = value & 0xFFFF_FFFF

    def function_level_reset(self) -> None:
        self.card.set_ctrl(0)
        self._reset_cap()
        self.inner.function_level_reset()


class FakeSriovCard:
    """A PF and up to `total_vfs` VFs; resources set by FakePfDriver."""

    def __init__(self, ports: DevicePorts, msi: MsiPort, platform: HostSriovPlatform,
                 source: str, config: Va1Config | None = None, total_vfs: int = 8) -> None:
        self.platform = platform
        self.total_vfs = total_vfs
        self.tracer = ports.tracer
        self.pf_device = Va1Device(config or Va1Config(), ports)
        self.pf = FakeSriovPf(self, VirtioPciFunction(self.pf_device, msi, tracer=ports.tracer))
        self.num_vfs = 0
        self.ctrl = 0
        self.vfs: list[FakeVf] = []
        self.resources: dict[int, VfResources] = {}
        self.refused: list[str] = []

    def _regs_put(self, off: int, size: int, value: int) -> None:
        self.pf.regs[off:off + size] = value.to_bytes(size, "little")

    def set_num_vfs(self, n: int) -> None:
        if self.ctrl & P.SRIOV_CTRL_VFE or n > self.total_vfs:
            self.refused.append(f"NumVFs={n}")
            return
        self.num_vfs = n
        self._regs_put(P.SRIOV_NUM_VF, 2, n)

    def _make_vf(self, n: int, res: VfResources) -> VirtioPciFunction:
        ports, msi = self.platform.vf_ports(n)
        cfg = Va1Config(device_memory_size=res.device_memory,
                        num_submit_queues=res.num_submit_queues, max_contexts=res.max_contexts)
        return VirtioPciFunction(Va1Device(cfg, ports), msi, tracer=ports.tracer)

    def set_ctrl(self, ctrl: int) -> None:
        was = self.ctrl & P.SRIOV_CTRL_VFE
        self.ctrl = ctrl
        self._regs_put(P.SRIOV_CTRL, 2, ctrl)
        if ctrl & P.SRIOV_CTRL_VFE and not was:
            self.vfs = [FakeVf(self._make_vf(n, self.resources.get(n, VfResources())))
                        for n in range(1, self.num_vfs + 1)]
            self.platform.vfs_enabled(list(self.vfs))
        elif was and not ctrl & P.SRIOV_CTRL_VFE:
            for vf in self.vfs:
                vf.inner.function_level_reset()
            self.vfs = []
            self.platform.vfs_disabled()

    def set_resources(self, vf: int, res: VfResources) -> None:
        if not 1 <= vf <= len(self.vfs):
            raise SriovError(f"no VF {vf}")
        self.resources[vf] = res
        self.vfs[vf - 1].inner = self._make_vf(vf, res)


def fake_card_factory(config: Va1Config | None = None, total_vfs: int = 8
                      ) -> Callable[..., tuple[PciFunction, object]]:
    def make(ports: DevicePorts, msi: MsiPort, platform: HostSriovPlatform, source: str
             ) -> tuple[PciFunction, object]:
        card = FakeSriovCard(ports, msi, platform, source, config, total_vfs)
        return card.pf, card
    return make


class FakePfDriver:
    """PF management over config space (ECAM through host-kernel MMIO); resources are
    handed to the fake card directly (the real driver uses the admin queue)."""

    def __init__(self, kernel: Any, hf: Any) -> None:
        self.kernel = kernel
        self.card: FakeSriovCard = hf.device
        bridge = kernel.pci_hosts[0]
        self.ecam = bridge.ecam_base + P.ecam_offset(hf.slot.bus, hf.slot.dev, hf.slot.fn)

    def _w(self, reg: int, size: int, value: int) -> None:
        self.kernel.mmio.write(self.ecam + CAP + reg, size, value)

    def _r(self, reg: int, size: int) -> int:
        return int(self.kernel.mmio.read(self.ecam + CAP + reg, size))

    def sriov_configure(self, num_vfs: int) -> int:
        self._w(P.SRIOV_CTRL, 2, 0)
        if num_vfs == 0:
            return 0
        self._w(P.SRIOV_NUM_VF, 2, num_vfs)
        if self._r(P.SRIOV_NUM_VF, 2) != num_vfs:
            raise SriovError(f"NumVFs {num_vfs} refused")
        self._w(P.SRIOV_CTRL, 2, P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE)
        return num_vfs

    def set_resources(self, vf: int, resources: Any) -> None:
        self.card.set_resources(vf, VfResources.from_mapping(resources))

    def get_resources(self, vf: int) -> VfResources:
        return self.card.resources.get(vf, VfResources())

    def stop(self, vf: int) -> None:
        raise NotImplementedError("the fake card has no VF stop")

    def resume(self, vf: int) -> None:
        raise NotImplementedError("the fake card has no VF resume")

    def stats(self, vf: int) -> dict[str, int]:
        m = self.card.vfs[vf - 1].device.metrics
        return {k: int(v) for k, v in vars(m).items() if isinstance(v, int)}

    def reset_vf(self, vf: int) -> None:
        self.card.vfs[vf - 1].function_level_reset()
