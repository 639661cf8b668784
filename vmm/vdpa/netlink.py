"""The "vdpa" generic netlink family, in process: real netlink bytes in, real netlink
bytes out (drivers/vdpa/vdpa.c), encoded and decoded with pyroute2's message classes.

Why: management tools (iproute2's `vdpa`, the product's `virtaccel vdpa`) speak netlink,
not Python; taking and answering bytes keeps the wire format honest, and a malformed
request is met where the kernel meets it. `GenlSocket` is a socket of the family: the
caller `send`s a request and `recv`s each answer in turn, as from an AF_NETLINK socket.

- The generic netlink controller (nlctrl, id 0x10) answers CTRL_CMD_GETFAMILY for "vdpa"
  with its id, version 1 and max attribute; another name: ENOENT.
- A request shorter than its headers or whose nlmsg_len overruns the bytes sent:
  EINVAL; a family id that is not vdpa's: ENOENT; a version other than 1: EINVAL; an
  unknown command (MGMTDEV_NEW included, which the kernel has no handler for):
  EOPNOTSUPP; NLM_F_DUMP on a command that cannot dump: EOPNOTSUPP.
- Attributes are validated strictly (the kernel's policy): a malformed TLV, an unknown
  attribute type, or a payload of the wrong size for its type (a string not
  NUL-terminated): EINVAL, the extack naming the attribute; a required one missing:
  EINVAL "Missing attribute VDPA_ATTR_...".
- DEV_NEW and DEV_DEL need an admin-capable socket (GENL_ADMIN_PERM): EPERM otherwise.
- The bus's own errors (ENODEV, EEXIST, EBUSY ...) come back with its message as extack.
Errors are NLMSG_ERROR messages (error = -errno, the request's header, then
NLMSGERR_ATTR_MSG); an NLM_F_ACK request that succeeds gets an error-0 ack. Dumps are
NLM_F_MULTI messages then NLMSG_DONE. Nothing a refused request names is changed.
"""
from __future__ import annotations

import errno
import struct
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from pyroute2.netlink import (CTRL_CMD_GETFAMILY, CTRL_CMD_NEWFAMILY, GENL_ID_CTRL,
                              NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_MULTI,
                              NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, ctrlmsg, genlmsg, nlmsg)

from hwspec import va1

from . import uapi
from .errors import VdpaError, vdpa_error

if TYPE_CHECKING:
    from .bus import MgmtDev, VdpaBus, VdpaDevice

VDPA_FAMILY_ID = 0x1C         # generic netlink ids are dynamic; this host gives vdpa 28
NLMSG_HDRLEN = 16
GENL_HDRLEN = 4
U64 = (1 << 64) - 1

# attribute payload types (pyroute2 nla names) as linux/vdpa.h comments them
_TYPES: dict[str, str] = {
    "VDPA_ATTR_UNSPEC": "none", "VDPA_ATTR_MGMTDEV_BUS_NAME": "asciiz",
    "VDPA_ATTR_MGMTDEV_DEV_NAME": "asciiz", "VDPA_ATTR_MGMTDEV_SUPPORTED_CLASSES": "uint64",
    "VDPA_ATTR_DEV_NAME": "asciiz", "VDPA_ATTR_DEV_ID": "uint32",
    "VDPA_ATTR_DEV_VENDOR_ID": "uint32", "VDPA_ATTR_DEV_MAX_VQS": "uint32",
    "VDPA_ATTR_DEV_MAX_VQ_SIZE": "uint16", "VDPA_ATTR_DEV_MIN_VQ_SIZE": "uint16",
    "VDPA_ATTR_DEV_NET_CFG_MACADDR": "l2addr", "VDPA_ATTR_DEV_NET_STATUS": "uint8",
    "VDPA_ATTR_DEV_NET_CFG_MAX_VQP": "uint16", "VDPA_ATTR_DEV_NET_CFG_MTU": "uint16",
    "VDPA_ATTR_DEV_NEGOTIATED_FEATURES": "uint64", "VDPA_ATTR_DEV_MGMTDEV_MAX_VQS": "uint32",
    "VDPA_ATTR_DEV_SUPPORTED_FEATURES": "uint64", "VDPA_ATTR_DEV_QUEUE_INDEX": "uint32",
    "VDPA_ATTR_DEV_VENDOR_ATTR_NAME": "asciiz", "VDPA_ATTR_DEV_VENDOR_ATTR_VALUE": "uint64",
    "VDPA_ATTR_DEV_FEATURES": "uint64", "VDPA_ATTR_VDPA_DEV_SUPPORTED_FEATURES": "uint64",
}
_SIZES = {"uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "l2addr": 6, "none": 0}


class vdpamsg(genlmsg):  # type: ignore[misc]
    """A message of the vdpa family: genl header, then VDPA_ATTR_* attributes."""
    prefix = "VDPA_ATTR_"
    nla_map = tuple((name, _TYPES[name]) for name in uapi.VDPA_ATTRS)


class nlmsgerr_ext(nlmsg):  # type: ignore[misc]
    """NLMSG_ERROR as the kernel sends it with extack: error, the request's header
    (capped: no payload), then NLMSGERR_ATTR_* attributes."""
    fields = (("error", "i"), ("orig_length", "I"), ("orig_type", "H"), ("orig_flags", "H"),
              ("orig_seq", "I"), ("orig_pid", "I"))
    nla_map = (("NLMSGERR_ATTR_UNUSED", "none"), ("NLMSGERR_ATTR_MSG", "asciiz"),
               ("NLMSGERR_ATTR_OFFS", "uint32"))


class nlmsgdone(nlmsg):  # type: ignore[misc]
    fields = (("error", "i"),)


def _encode(msg: nlmsg, kind: int, flags: int, seq: int, pid: int) -> bytes:
    msg["header"]["type"] = kind
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg["header"]["pid"] = pid
    msg.encode()
    return bytes(msg.data)


class VdpaGenl:
    """The kernel side of the family, over one host's vdpa bus."""

    def __init__(self, bus: "VdpaBus") -> None:
        self.bus = bus
        self.requests = 0
        self.refused = 0
        self._next_port = 1000

    def socket(self, *, admin: bool = True) -> "GenlSocket":
        """A NETLINK_GENERIC socket; `admin`: the opener has CAP_NET_ADMIN."""
        self._next_port += 1
        return GenlSocket(self, self._next_port, admin)

    # -- one request ----------------------------------------------------------------------

    def handle(self, data: bytes, port: int, admin: bool) -> list[bytes]:
        """Answer one request (every message in `data`); the answers' bytes in order."""
        self.requests += 1
        head = data[:NLMSG_HDRLEN].ljust(NLMSG_HDRLEN, b"\0")
        length, kind, flags, seq, _pid = struct.unpack("=IHHII", head)
        try:
            if len(data) < NLMSG_HDRLEN:
                raise vdpa_error(errno.EINVAL, f"truncated message: {len(data)} bytes, the "
                                             f"netlink header alone is {NLMSG_HDRLEN}")
            if length < NLMSG_HDRLEN + GENL_HDRLEN or length > len(data):
                raise vdpa_error(errno.EINVAL, f"truncated message: nlmsg_len {length}, "
                                             f"{len(data)} bytes sent, generic netlink needs "
                                             f"at least {NLMSG_HDRLEN + GENL_HDRLEN}")
            body = data[:length]
            cmd, version = body[NLMSG_HDRLEN], body[NLMSG_HDRLEN + 1]
            if kind == GENL_ID_CTRL:
                return [self._ctrl(body, seq, port)]
            if kind != VDPA_FAMILY_ID:
                raise vdpa_error(errno.ENOENT, f"no generic netlink family with id {kind}")
            if version != uapi.VDPA_GENL_VERSION:
                raise vdpa_error(errno.EINVAL, f"vdpa family version {version} (this kernel "
                                             f"speaks {uapi.VDPA_GENL_VERSION})")
            attrs = self._attrs(body)
            out = self._command(cmd, flags, attrs, admin, seq, port)
            if flags & NLM_F_ACK and not flags & NLM_F_DUMP:
                out.append(self._error(0, "", head, seq, port))
            return out
        except VdpaError as e:
            self.refused += 1
            return [self._error(e.errno or errno.EINVAL, e.strerror or str(e), head, seq, port)]

    def _error(self, code: int, text: str, orig: bytes, seq: int, port: int) -> bytes:
        o_len, o_type, o_flags, o_seq, o_pid = struct.unpack("=IHHII", orig)
        m = nlmsgerr_ext()
        m["error"] = -code
        m["orig_length"], m["orig_type"], m["orig_flags"] = o_len, o_type, o_flags
        m["orig_seq"], m["orig_pid"] = o_seq, o_pid
        flags = NLM_F_CAPPED
        if text:
            m["attrs"] = [("NLMSGERR_ATTR_MSG", text)]
            flags |= NLM_F_ACK_TLVS
        return _encode(m, NLMSG_ERROR, flags, seq, port)

    def _ctrl(self, body: bytes, seq: int, port: int) -> bytes:
        req = ctrlmsg(body)
        req.decode()
        if req["cmd"] != CTRL_CMD_GETFAMILY:
            raise vdpa_error(errno.EOPNOTSUPP, f"nlctrl command {req['cmd']} is not GETFAMILY")
        name = req.get_attr("CTRL_ATTR_FAMILY_NAME")
        if name != uapi.VDPA_GENL_NAME:
            raise vdpa_error(errno.ENOENT, f"no generic netlink family named {name!r}")
        r = ctrlmsg()
        r["cmd"], r["version"] = CTRL_CMD_NEWFAMILY, 2
        r["attrs"] = [("CTRL_ATTR_FAMILY_ID", VDPA_FAMILY_ID),
                      ("CTRL_ATTR_FAMILY_NAME", uapi.VDPA_GENL_NAME),
                      ("CTRL_ATTR_VERSION", uapi.VDPA_GENL_VERSION),
                      ("CTRL_ATTR_HDRSIZE", 0), ("CTRL_ATTR_MAXATTR", uapi.VDPA_ATTR_MAX - 1)]
        return _encode(r, GENL_ID_CTRL, 0, seq, port)

    @staticmethod
    def _attrs(body: bytes) -> dict[str, Any]:
        """Strict attribute validation (TLV framing, known types, payload sizes), then
        pyroute2's decoding; {name: value}."""
        pos = NLMSG_HDRLEN + GENL_HDRLEN
        while pos < len(body):
            if len(body) - pos < 4:
                raise vdpa_error(errno.EINVAL, f"truncated attribute header at byte {pos}")
            alen, atype = struct.unpack_from("=HH", body, pos)
            atype &= 0x3FFF
            if alen < 4 or pos + alen > len(body):
                raise vdpa_error(errno.EINVAL, f"attribute at byte {pos}: length {alen} overruns "
                                             "the message")
            if not 0 < atype < uapi.VDPA_ATTR_MAX:
                raise vdpa_error(errno.EINVAL, f"Unknown attribute type {atype} at byte {pos}")
            name = uapi.VDPA_ATTRS[atype]
            kind, payload = _TYPES[name], body[pos + 4:pos + alen]
            want = _SIZES.get(kind)
            if want is not None and len(payload) != want:
                raise vdpa_error(errno.EINVAL, f"{name}: payload of {len(payload)} bytes, "
                                             f"{want} expected")
            if kind == "asciiz" and (not payload or payload[-1:] != b"\0"
                                     or b"\0" in payload[:-1].rstrip(b"\0")):
                raise vdpa_error(errno.EINVAL, f"{name}: not a NUL-terminated string")
            pos += (alen + 3) & ~3
        msg = vdpamsg(body)
        msg.decode()
        return {k: v for k, v in msg["attrs"]}

    # -- commands -------------------------------------------------------------------------

    def _command(self, cmd: int, flags: int, attrs: dict[str, Any], admin: bool, seq: int,
                 port: int) -> list[bytes]:
        dump = bool(flags & NLM_F_DUMP)
        table: dict[int, tuple[Callable[..., list[vdpamsg]], bool, bool]] = {
            # cmd: (handler, can dump, needs admin)
            uapi.VDPA_CMD_MGMTDEV_GET: (self._mgmtdev_get, True, False),
            uapi.VDPA_CMD_DEV_NEW: (self._dev_new, False, True),
            uapi.VDPA_CMD_DEV_DEL: (self._dev_del, False, True),
            uapi.VDPA_CMD_DEV_GET: (self._dev_get, True, False),
            uapi.VDPA_CMD_DEV_CONFIG_GET: (self._dev_config_get, True, False),
            uapi.VDPA_CMD_DEV_VSTATS_GET: (self._dev_vstats_get, False, False),
        }
        entry = table.get(cmd)
        if entry is None:
            raise vdpa_error(errno.EOPNOTSUPP, f"vdpa command {cmd} is not supported")
        handler, can_dump, needs_admin = entry
        if needs_admin and not admin:
            raise vdpa_error(errno.EPERM, f"{uapi.COMMANDS[cmd]} needs CAP_NET_ADMIN")
        if dump and not can_dump:
            raise vdpa_error(errno.EOPNOTSUPP, f"{uapi.COMMANDS[cmd]} cannot dump")
        replies = handler(attrs, dump)
        out = []
        for r in replies:
            r["cmd"], r["version"] = cmd, uapi.VDPA_GENL_VERSION
            out.append(_encode(r, VDPA_FAMILY_ID, NLM_F_MULTI if dump else 0, seq, port))
        if dump:
            done = nlmsgdone()
            done["error"] = 0
            out.append(_encode(done, NLMSG_DONE, NLM_F_MULTI, seq, port))
        return out

    @staticmethod
    def _need(attrs: dict[str, Any], *names: str) -> list[Any]:
        for n in names:
            if n not in attrs:
                raise vdpa_error(errno.EINVAL, f"Missing attribute {n}")
        return [attrs[n] for n in names]

    def _mgmtdev_handle(self, attrs: dict[str, Any]) -> str:
        (dev,) = self._need(attrs, "VDPA_ATTR_MGMTDEV_DEV_NAME")
        bus = attrs.get("VDPA_ATTR_MGMTDEV_BUS_NAME")
        return f"{bus}/{dev}" if bus else self._by_dev_name(dev)

    def _by_dev_name(self, dev: str) -> str:
        for h, m in self.bus.mgmtdevs.items():
            if m.dev_name == dev:
                return h
        return dev

    @staticmethod
    def _mgmt_attrs(m: "MgmtDev") -> vdpamsg:
        r = vdpamsg()
        r["attrs"] = [("VDPA_ATTR_MGMTDEV_BUS_NAME", m.bus_name),
                      ("VDPA_ATTR_MGMTDEV_DEV_NAME", m.dev_name),
                      ("VDPA_ATTR_MGMTDEV_SUPPORTED_CLASSES", m.supported_classes),
                      ("VDPA_ATTR_DEV_MGMTDEV_MAX_VQS", m.max_vqs),
                      ("VDPA_ATTR_DEV_SUPPORTED_FEATURES", m.supported_features)]
        return r

    def _mgmtdev_get(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        if dump:
            return [self._mgmt_attrs(m) for m in self.bus.mgmtdevs.values()]
        return [self._mgmt_attrs(self.bus.mgmtdev(self._mgmtdev_handle(attrs)))]

    def _dev_new(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        (name,) = self._need(attrs, "VDPA_ATTR_DEV_NAME")
        handle = self._mgmtdev_handle(attrs)
        unsupported = [a for a in attrs if a.startswith("VDPA_ATTR_DEV_NET_")
                       or a in ("VDPA_ATTR_DEV_FEATURES",)]
        if unsupported:
            raise vdpa_error(errno.EOPNOTSUPP, "Some provided attributes are not supported: "
                                             + ", ".join(unsupported))
        self.bus.dev_add(name, handle)
        return []

    def _dev_del(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        (name,) = self._need(attrs, "VDPA_ATTR_DEV_NAME")
        self.bus.dev_del(name)
        return []

    @staticmethod
    def _dev_attrs(d: "VdpaDevice") -> vdpamsg:
        p = d.parent
        r = vdpamsg()
        r["attrs"] = [("VDPA_ATTR_DEV_NAME", d.name),
                      ("VDPA_ATTR_MGMTDEV_BUS_NAME", d.mgmtdev.bus_name),
                      ("VDPA_ATTR_MGMTDEV_DEV_NAME", d.mgmtdev.dev_name),
                      ("VDPA_ATTR_DEV_ID", p.device_id), ("VDPA_ATTR_DEV_VENDOR_ID", p.vendor_id),
                      ("VDPA_ATTR_DEV_MAX_VQS", p.num_queues),
                      ("VDPA_ATTR_DEV_MAX_VQ_SIZE", p.vq_num_max),
                      ("VDPA_ATTR_DEV_MIN_VQ_SIZE", 1)]
        return r

    def _dev_get(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        if dump:
            return [self._dev_attrs(d) for d in self.bus.devices.values()]
        (name,) = self._need(attrs, "VDPA_ATTR_DEV_NAME")
        return [self._dev_attrs(self.bus.device(name))]

    @staticmethod
    def _config_attrs(d: "VdpaDevice") -> vdpamsg:
        """Name, id, features, then every va1_config field as a vendor name/value pair."""
        p = d.parent
        a: list[tuple[str, Any]] = [("VDPA_ATTR_DEV_NAME", d.name),
                                    ("VDPA_ATTR_DEV_ID", p.device_id),
                                    ("VDPA_ATTR_DEV_FEATURES", p.device_features)]
        from hwspec import virtio as V
        if p.get_status() & V.STATUS_FEATURES_OK:
            a.append(("VDPA_ATTR_DEV_NEGOTIATED_FEATURES", p.get_driver_features()))
        raw = p.get_config(0, min(p.get_config_size(), va1.CONFIG.size))
        if len(raw) == va1.CONFIG.size:
            for field, value in zip(va1.CONFIG.names, struct.unpack(va1.CONFIG.format, raw)):
                if field != "reserved":
                    a += [("VDPA_ATTR_DEV_VENDOR_ATTR_NAME", field),
                          ("VDPA_ATTR_DEV_VENDOR_ATTR_VALUE", int(value) & U64)]
        r = vdpamsg()
        r["attrs"] = a
        return r

    def _dev_config_get(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        if dump:
            return [self._config_attrs(d) for d in self.bus.devices.values()]
        (name,) = self._need(attrs, "VDPA_ATTR_DEV_NAME")
        return [self._config_attrs(self.bus.device(name))]

    def _dev_vstats_get(self, attrs: dict[str, Any], dump: bool) -> list[vdpamsg]:
        name, index = self._need(attrs, "VDPA_ATTR_DEV_NAME", "VDPA_ATTR_DEV_QUEUE_INDEX")
        d = self.bus.device(name)
        p = d.parent
        from hwspec import virtio as V
        if not p.get_status() & V.STATUS_FEATURES_OK:
            raise vdpa_error(errno.EAGAIN, "feature negotiation not complete")
        if not 0 <= index < p.num_queues:
            raise vdpa_error(errno.EINVAL, f"queue index {index} exceeds the {p.num_queues} "
                                         "queues of the device")
        r = vdpamsg()
        a: list[tuple[str, Any]] = [("VDPA_ATTR_DEV_NAME", d.name),
                                    ("VDPA_ATTR_DEV_NEGOTIATED_FEATURES",
                                     p.get_driver_features()),
                                    ("VDPA_ATTR_DEV_QUEUE_INDEX", index)]
        for key, value in self.bus.vq_stats(d, index).items():
            a += [("VDPA_ATTR_DEV_VENDOR_ATTR_NAME", key),
                  ("VDPA_ATTR_DEV_VENDOR_ATTR_VALUE", value & U64)]
        r["attrs"] = a
        return [r]


class GenlSocket:
    """One NETLINK_GENERIC socket on the in-process family: send() requests, recv()
    answers in order (BlockingIOError when none is waiting, as a non-blocking socket)."""

    def __init__(self, genl: VdpaGenl, port: int, admin: bool) -> None:
        self.genl = genl
        self.port = port
        self.admin = admin
        self._rx: deque[bytes] = deque()
        self.closed = False

    def send(self, data: bytes) -> int:
        if self.closed:
            raise OSError(errno.EBADF, "netlink socket is closed")
        self._rx.extend(self.genl.handle(bytes(data), self.port, self.admin))
        return len(data)

    def recv(self) -> bytes:
        if not self._rx:
            raise BlockingIOError(errno.EAGAIN, "no netlink message waiting")
        return self._rx.popleft()

    def close(self) -> None:
        self.closed = True
        self._rx.clear()


class VdpaClient:
    """iproute2's `vdpa` as a library: builds requests with pyroute2, parses the answers,
    raises VdpaError(errno, extack) for a netlink error."""

    def __init__(self, sock: GenlSocket) -> None:
        self.sock = sock
        self.seq = 0
        self.family = self._resolve()

    def _roundtrip(self, data: bytes) -> list[bytes]:
        self.sock.send(data)
        out = []
        while True:
            try:
                out.append(self.sock.recv())
            except BlockingIOError:
                return out

    @staticmethod
    def _check(raw: bytes) -> None:
        kind = struct.unpack_from("=H", raw, 4)[0]
        if kind == NLMSG_ERROR:
            e = nlmsgerr_ext(raw)
            e.decode()
            if e["error"]:
                raise vdpa_error(-int(e["error"]), e.get_attr("NLMSGERR_ATTR_MSG") or
                                 f"netlink error {-int(e['error'])}")

    def _resolve(self) -> int:
        self.seq += 1
        m = ctrlmsg()
        m["cmd"], m["version"] = CTRL_CMD_GETFAMILY, 1
        m["attrs"] = [("CTRL_ATTR_FAMILY_NAME", uapi.VDPA_GENL_NAME)]
        replies = self._roundtrip(_encode(m, GENL_ID_CTRL, NLM_F_REQUEST, self.seq,
                                          self.sock.port))
        self._check(replies[0])
        r = ctrlmsg(replies[0])
        r.decode()
        return int(r.get_attr("CTRL_ATTR_FAMILY_ID"))

    def request(self, cmd: int, attrs: list[tuple[str, Any]], *, dump: bool = False,
                ack: bool = False) -> list[list[tuple[str, Any]]]:
        """One request; the attribute lists of the answers (a NLMSG_ERROR raises)."""
        self.seq += 1
        m = vdpamsg()
        m["cmd"], m["version"] = cmd, uapi.VDPA_GENL_VERSION
        m["attrs"] = attrs
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0) | (NLM_F_ACK if ack else 0)
        out: list[list[tuple[str, Any]]] = []
        for raw in self._roundtrip(_encode(m, self.family, flags, self.seq, self.sock.port)):
            self._check(raw)
            kind = struct.unpack_from("=H", raw, 4)[0]
            if kind in (NLMSG_DONE, NLMSG_ERROR):
                continue
            r = vdpamsg(raw)
            r.decode()
            out.append([(k, v) for k, v in r["attrs"]])
        return out

    # -- what iproute2's vdpa does ----------------------------------------------------------

    @staticmethod
    def _mgmt(handle: str) -> list[tuple[str, Any]]:
        bus, _, dev = handle.rpartition("/")
        attrs: list[tuple[str, Any]] = [("VDPA_ATTR_MGMTDEV_DEV_NAME", dev)]
        if bus:
            attrs.insert(0, ("VDPA_ATTR_MGMTDEV_BUS_NAME", bus))
        return attrs

    def mgmtdev_show(self, handle: str | None = None) -> list[list[tuple[str, Any]]]:
        if handle is None:
            return self.request(uapi.VDPA_CMD_MGMTDEV_GET, [], dump=True)
        return self.request(uapi.VDPA_CMD_MGMTDEV_GET, self._mgmt(handle))

    def dev_add(self, name: str, mgmtdev: str) -> None:
        self.request(uapi.VDPA_CMD_DEV_NEW, [("VDPA_ATTR_DEV_NAME", name)] + self._mgmt(mgmtdev),
                     ack=True)

    def dev_del(self, name: str) -> None:
        self.request(uapi.VDPA_CMD_DEV_DEL, [("VDPA_ATTR_DEV_NAME", name)], ack=True)

    def dev_show(self, name: str | None = None) -> list[list[tuple[str, Any]]]:
        if name is None:
            return self.request(uapi.VDPA_CMD_DEV_GET, [], dump=True)
        return self.request(uapi.VDPA_CMD_DEV_GET, [("VDPA_ATTR_DEV_NAME", name)])

    def dev_config_show(self, name: str | None = None) -> list[list[tuple[str, Any]]]:
        if name is None:
            return self.request(uapi.VDPA_CMD_DEV_CONFIG_GET, [], dump=True)
        return self.request(uapi.VDPA_CMD_DEV_CONFIG_GET, [("VDPA_ATTR_DEV_NAME", name)])

    def dev_vstats_show(self, name: str, qidx: int) -> list[list[tuple[str, Any]]]:
        return self.request(uapi.VDPA_CMD_DEV_VSTATS_GET, [("VDPA_ATTR_DEV_NAME", name),
                                                           ("VDPA_ATTR_DEV_QUEUE_INDEX", qidx)])


__all__ = ["VdpaGenl", "GenlSocket", "VdpaClient", "vdpamsg", "nlmsgerr_ext",
           "VDPA_FAMILY_ID"]
