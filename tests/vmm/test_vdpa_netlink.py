"""The "vdpa" generic netlink family: every message built and parsed with pyroute2, and
every bad request answered with a netlink error (errno + extack) that changes nothing."""
from __future__ import annotations

import errno
import struct
from typing import Any, Iterator

import pytest
from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR

from vmm.host import Host
from vmm.machine import Machine
from vmm.memory import GuestMemory, HostMemory
from vmm.vdpa import VdpaError, uapi
from vmm.vdpa.netlink import VDPA_FAMILY_ID, VdpaClient, nlmsgerr_ext, vdpamsg

PF0, PF1 = "pci/0000:01:00.0", "pci/0000:01:01.0"


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host(Machine(7))
    for dev in (0, 1):
        h.vdpa.register(h.add_va1(dev=dev))
    yield h
    h.close()


def client(host: Host, admin: bool = True) -> VdpaClient:
    return VdpaClient(host.vdpa.genl.socket(admin=admin))


def attrs_of(reply: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(reply)


def state(host: Host) -> tuple[Any, ...]:
    return tuple(sorted((d.name, d.mgmtdev.handle, d.index, d.opened is None)
                        for d in host.vdpa.devices.values()))


def raw(host: Host, data: bytes, admin: bool = True) -> tuple[int, str]:
    """Send raw bytes; the (errno, extack) of the one NLMSG_ERROR answer."""
    sock = host.vdpa.genl.socket(admin=admin)
    sock.send(data)
    answer = sock.recv()
    assert struct.unpack_from("=H", answer, 4)[0] == NLMSG_ERROR
    e = nlmsgerr_ext(answer)
    e.decode()
    return -int(e["error"]), str(e.get_attr("NLMSGERR_ATTR_MSG"))


def request(cmd: int, attrs: list[tuple[str, Any]], *, family: int = VDPA_FAMILY_ID,
            version: int = 1, flags: int = NLM_F_REQUEST) -> bytes:
    m = vdpamsg()
    m["cmd"], m["version"], m["attrs"] = cmd, version, attrs
    m["header"]["type"], m["header"]["flags"], m["header"]["sequence_number"] = family, flags, 9
    m.encode()
    return bytes(m.data)


def test_every_message_round_trips(host: Host) -> None:
    c = client(host)
    assert c.family == VDPA_FAMILY_ID
    mgmt = [attrs_of(r) for r in c.mgmtdev_show()]
    assert [f"{m['VDPA_ATTR_MGMTDEV_BUS_NAME']}/{m['VDPA_ATTR_MGMTDEV_DEV_NAME']}" for m in mgmt] \
        == [PF0, PF1]
    one = attrs_of(c.mgmtdev_show(PF1)[0])
    assert one["VDPA_ATTR_DEV_MGMTDEV_MAX_VQS"] == 4
    assert one["VDPA_ATTR_MGMTDEV_SUPPORTED_CLASSES"] == 1 << 60   # VA-1 is virtio id 60
    c.dev_add("acc0", PF0)
    c.dev_add("acc1", PF1)
    devs = {attrs_of(r)["VDPA_ATTR_DEV_NAME"]: attrs_of(r) for r in c.dev_show()}
    assert set(devs) == {"acc0", "acc1"}
    d = attrs_of(c.dev_show("acc1")[0])
    assert (d["VDPA_ATTR_MGMTDEV_DEV_NAME"], d["VDPA_ATTR_DEV_ID"], d["VDPA_ATTR_DEV_MAX_VQS"],
            d["VDPA_ATTR_DEV_MAX_VQ_SIZE"]) == ("0000:01:01.0", 60, 4, 256)
    cfg = c.dev_config_show("acc0")[0]
    names = [v for k, v in cfg if k == "VDPA_ATTR_DEV_VENDOR_ATTR_NAME"]
    values = [v for k, v in cfg if k == "VDPA_ATTR_DEV_VENDOR_ATTR_VALUE"]
    assert dict(zip(names, values))["num_submit_queues"] == 2
    assert len(c.dev_config_show()) == 2
    c.dev_del("acc1")
    assert [attrs_of(r)["VDPA_ATTR_DEV_NAME"] for r in c.dev_show()] == ["acc0"]


def test_vstats_once_features_are_negotiated(host: Host) -> None:
    c = client(host)
    c.dev_add("acc0", PF0)
    with pytest.raises(VdpaError) as e:
        c.dev_vstats_show("acc0", 0)
    assert e.value.errno == errno.EAGAIN
    parent = host.vdpa.device("acc0").parent
    parent.set_status(0x03)                                   # ACK | DRIVER
    parent.set_driver_features(1 << 32)                       # VERSION_1
    parent.set_status(0x0B)                                   # | FEATURES_OK
    stats = c.dev_vstats_show("acc0", 2)[0]
    assert attrs_of(stats)["VDPA_ATTR_DEV_QUEUE_INDEX"] == 2
    assert [v for k, v in stats if k == "VDPA_ATTR_DEV_VENDOR_ATTR_NAME"] == \
        ["received_desc", "completed_desc", "kicks", "calls"]
    with pytest.raises(VdpaError) as e:
        c.dev_vstats_show("acc0", 4)
    assert e.value.errno == errno.EINVAL and "queue index 4" in str(e.value)


def test_dump_ends_with_done_and_ack_is_error_zero(host: Host) -> None:
    sock = host.vdpa.genl.socket()
    sock.send(request(uapi.VDPA_CMD_MGMTDEV_GET, [], flags=NLM_F_REQUEST | NLM_F_DUMP))
    kinds = []
    while True:
        try:
            kinds.append(struct.unpack_from("=H", sock.recv(), 4)[0])
        except BlockingIOError:
            break
    assert kinds == [VDPA_FAMILY_ID, VDPA_FAMILY_ID, NLMSG_DONE]
    assert raw(host, request(uapi.VDPA_CMD_DEV_NEW, [("VDPA_ATTR_DEV_NAME", "a"),
                                                     ("VDPA_ATTR_MGMTDEV_BUS_NAME", "pci"),
                                                     ("VDPA_ATTR_MGMTDEV_DEV_NAME", "0000:01:00.0")],
                                     flags=NLM_F_REQUEST | NLM_F_ACK)) == (0, "None")


NEW = [("VDPA_ATTR_DEV_NAME", "acc9"), ("VDPA_ATTR_MGMTDEV_BUS_NAME", "pci"),
       ("VDPA_ATTR_MGMTDEV_DEV_NAME", "0000:01:01.0")]


def _unknown_attr() -> bytes:
    data = request(uapi.VDPA_CMD_DEV_GET, [("VDPA_ATTR_DEV_NAME", "acc0")]) + \
        struct.pack("=HHI", 8, 77, 0)
    return struct.pack("=I", len(data)) + data[4:]


def _bad_u32() -> bytes:
    data = request(uapi.VDPA_CMD_DEV_VSTATS_GET, [("VDPA_ATTR_DEV_NAME", "acc0")]) + \
        struct.pack("=HHH2x", 6, uapi.VDPA_ATTR_DEV_QUEUE_INDEX, 1)
    return struct.pack("=I", len(data)) + data[4:]


@pytest.mark.parametrize("case, data, admin, code, text", [
    ("truncated header", request(uapi.VDPA_CMD_DEV_NEW, NEW)[:10], True, errno.EINVAL,
     "truncated"),
    ("nlmsg_len overruns", request(uapi.VDPA_CMD_DEV_NEW, NEW)[:-8], True, errno.EINVAL,
     "truncated"),
    ("wrong family id", request(uapi.VDPA_CMD_DEV_NEW, NEW, family=0x33), True, errno.ENOENT,
     "family"),
    ("wrong version", request(uapi.VDPA_CMD_DEV_NEW, NEW, version=2), True, errno.EINVAL,
     "version 2"),
    ("unknown command", request(42, NEW), True, errno.EOPNOTSUPP, "command 42"),
    ("MGMTDEV_NEW", request(uapi.VDPA_CMD_MGMTDEV_NEW, NEW), True, errno.EOPNOTSUPP,
     "not supported"),
    ("dump of DEV_NEW", request(uapi.VDPA_CMD_DEV_NEW, NEW, flags=NLM_F_REQUEST | NLM_F_DUMP),
     True, errno.EOPNOTSUPP, "cannot dump"),
    ("unknown attribute", _unknown_attr(), True, errno.EINVAL, "Unknown attribute type 77"),
    ("u32 of 2 bytes", _bad_u32(), True, errno.EINVAL, "VDPA_ATTR_DEV_QUEUE_INDEX"),
    ("missing dev name", request(uapi.VDPA_CMD_DEV_NEW, NEW[1:]), True, errno.EINVAL,
     "Missing attribute VDPA_ATTR_DEV_NAME"),
    ("missing mgmtdev", request(uapi.VDPA_CMD_DEV_NEW, NEW[:1]), True, errno.EINVAL,
     "Missing attribute VDPA_ATTR_MGMTDEV_DEV_NAME"),
    ("missing queue index", request(uapi.VDPA_CMD_DEV_VSTATS_GET, NEW[:1]), True, errno.EINVAL,
     "Missing attribute VDPA_ATTR_DEV_QUEUE_INDEX"),
    ("duplicate name", request(uapi.VDPA_CMD_DEV_NEW, [("VDPA_ATTR_DEV_NAME", "acc0")] + NEW[1:]),
     True, errno.EEXIST, "already exists"),
    ("no such mgmtdev", request(uapi.VDPA_CMD_DEV_NEW, NEW[:2] + [
        ("VDPA_ATTR_MGMTDEV_DEV_NAME", "0000:07:00.0")]), True, errno.ENODEV, "does not exist"),
    ("net attributes", request(uapi.VDPA_CMD_DEV_NEW, NEW + [("VDPA_ATTR_DEV_NET_CFG_MTU", 1500)]),
     True, errno.EOPNOTSUPP, "VDPA_ATTR_DEV_NET_CFG_MTU"),
    ("DEV_NEW without admin", request(uapi.VDPA_CMD_DEV_NEW, NEW), False, errno.EPERM,
     "CAP_NET_ADMIN"),
    ("DEV_DEL without admin", request(uapi.VDPA_CMD_DEV_DEL, [("VDPA_ATTR_DEV_NAME", "acc0")]),
     False, errno.EPERM, "CAP_NET_ADMIN"),
    ("DEV_DEL of nothing", request(uapi.VDPA_CMD_DEV_DEL, [("VDPA_ATTR_DEV_NAME", "nope")]),
     True, errno.ENODEV, "'nope' does not exist"),
])
def test_bad_request_gets_errno_and_extack_and_changes_nothing(
        host: Host, case: str, data: bytes, admin: bool, code: int, text: str) -> None:
    client(host).dev_add("acc0", PF0)
    before = state(host)
    got, extack = raw(host, data, admin)
    assert (got, text in extack) == (code, True), (case, got, extack)
    assert state(host) == before


def test_deleting_a_device_whose_vhost_file_is_open(host: Host) -> None:
    c = client(host)
    c.dev_add("acc0", PF0)
    hm = HostMemory(1 << 20)
    f = host.vdpa.open("/dev/vhost-vdpa-0", [GuestMemory(hm, 0, 1 << 20)])
    before = state(host)
    with pytest.raises(VdpaError) as e:
        c.dev_del("acc0")
    assert e.value.errno == errno.EBUSY and "is open" in str(e.value)
    assert state(host) == before
    f.close()
    c.dev_del("acc0")
    assert host.vdpa.devices == {}
    hm.close()


def test_unknown_family_name_and_closed_socket(host: Host) -> None:
    from pyroute2.netlink import CTRL_CMD_GETFAMILY, GENL_ID_CTRL, ctrlmsg
    m = ctrlmsg()
    m["cmd"], m["version"], m["attrs"] = CTRL_CMD_GETFAMILY, 1, [("CTRL_ATTR_FAMILY_NAME", "vdpx")]
    m["header"]["type"], m["header"]["flags"] = GENL_ID_CTRL, NLM_F_REQUEST
    m.encode()
    assert raw(host, bytes(m.data))[0] == errno.ENOENT
    sock = host.vdpa.genl.socket()
    sock.close()
    with pytest.raises(OSError):
        sock.send(b"x" * 20)
