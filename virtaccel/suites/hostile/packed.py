"""Packed-ring scenarios (virtio 1.x §2.8, VA-1 spec §4.6-4.8), with the bring-up
features around it: NOTIFICATION_DATA that claims what the ring does not hold, and
RING_RESET of a queue that may not be reset. The attacker brings its function up again
with the features the scenario needs (the session's functions offer every option), then
writes its packed ring by hand. Every case must end in DEVICE_NEEDS_RESET with its rule,
and the after-reset probe runs on a packed ring again: full function back.
"""
from __future__ import annotations

import dataclasses

import struct
from typing import Callable

from device_model.va1.config import VIRTIO_OPTIONS
from hwspec import va1 as A
from hwspec import virtio as V

from .core import Attack, Scenario
from .raw import BASE_FEATURES, QUEUE_SIZE, RawPackedQueue
from .ring import _ctrl_bufs, _submit_bufs

CAT = "packed ring"
SETTLE_NS = 200_000
PACKED = BASE_FEATURES | 1 << V.F_RING_PACKED
EVENT_IDX = 1 << V.F_RING_EVENT_IDX
DATA = 1 << V.F_NOTIFICATION_DATA
RESET = 1 << V.F_RING_RESET
OFFER_ALL = (("virtio_features", VIRTIO_OPTIONS),)
# controlq answers take 50 us here, so a queue reset can land while one is in flight
# even behind the VM exit of the notification (1 us)
SLOW_CTRL = OFFER_ALL + (("cmd_overhead_ns", 50_000),)

Craft = Callable[[Attack, RawPackedQueue], None]


def _scenario(name: str, rule: str, doc: str, craft: Craft, *, features: int = PACKED,
              queue: int = A.FIRST_SUBMITQ, notify: bool = True,
              config: tuple[tuple[str, int], ...] = OFFER_ALL) -> Scenario:
    def program(a: Attack) -> None:
        if not a.dev.bring_up(features):
            raise RuntimeError(f"bring-up with features {features:#x} failed (status "
                               f"{a.dev.t.status():#x}): the session offers them")
        a.probe_features = features
        a.ctx = a.dev.create_context()
        q = a.dev.queues[queue]
        craft(a, q)
        if notify:
            a.dev.t.notify(queue)
        a.sleep(SETTLE_NS)
        if not a.dev.needs_reset():
            a.breach(rule, f"no DEVICE_NEEDS_RESET after {doc} (spec §4.6-4.8)")
    return Scenario(f"packed/{name}", CAT, rule, program, doc=doc, device_config=config)


def _bufs(a: Attack, q: RawPackedQueue) -> list[tuple[int, int, bool]]:
    if q.index == A.CONTROLQ:
        req, resp = _ctrl_bufs(a)
        return [(req, A.CTRL_REQ.size, False), (resp, A.STATS_RESP.size, True)]
    req, resp = _submit_bufs(a)
    return [(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]


def _polarity(a: Attack, q: RawPackedQueue) -> None:
    """The head says AVAIL = USED = the wrap counter: a used descriptor, not an available one."""
    (req, n, _), (resp, m, _) = _bufs(a, q)
    q.write_desc(q.slot + 1, resp, m, q.slot, q.avail_flags(write=True))
    q.write_desc(q.slot, req, n, q.slot, V.DESC_F_AVAIL | V.DESC_F_USED | V.DESC_F_NEXT)


def _id_in_flight(a: Attack, q: RawPackedQueue) -> None:
    """Two controlq requests with one buffer id: the second while the first is in flight."""
    first = q.add(_bufs(a, q), bid=3)
    second = q.add(_bufs(a, q), bid=3)
    q.put_avail(first)
    q.put_avail(second)


def _id_range(a: Attack, q: RawPackedQueue) -> None:
    q.put_avail(q.add(_bufs(a, q), bid=QUEUE_SIZE + 5))


def _chain_wraps(a: Attack, q: RawPackedQueue) -> None:
    """Good requests bring the ring to two slots before its end; then a list of three that
    wraps with the last descriptor still flagged for the old wrap counter."""
    while q.slot != q.size - 2:
        if a.dev.request(q.index, _bufs(a, q)) is None:
            raise RuntimeError("a good controlq request on the packed ring was not answered")
    (req, n, _), (resp, m, _) = _bufs(a, q)
    head, old = q.slot, q.wrap
    q.write_desc(head, req, n, head, 0)
    q.write_desc(head + 1, resp, m // 2, head, q.avail_flags(write=True, nxt=True))
    q.write_desc(0, resp + m // 2, m - m // 2, head, q.avail_flags(write=True, wrap=old))
    q.advance(3)
    q.put_avail((head, q.avail_flags(nxt=True, wrap=old)))


def _indirect(kind: str) -> Craft:
    def craft(a: Attack, q: RawPackedQueue) -> None:
        table = a.dev.alloc.alloc(16 * 4, 16)
        (req, n, _), (resp, m, _) = _bufs(a, q)
        entries = [(req, n, 0), (resp, m, V.DESC_F_WRITE)]
        length, flags = 32, V.DESC_F_INDIRECT
        if kind == "nested":
            entries = [(table, 32, V.DESC_F_INDIRECT)]
            length = 16
        elif kind == "with-next":
            flags |= V.DESC_F_NEXT
        elif kind == "bad-len":
            length = 24
        for i, (addr, ln, fl) in enumerate(entries):
            a.dev.mem.write(table + 16 * i, struct.pack(V.PACKED_DESC.format, addr, ln, 0, fl))
        head = q.slot
        q.write_desc(head, table, length, head, 0)
        q.advance()
        if kind == "with-next":   # the list goes on into a plain descriptor
            q.write_desc(q.slot, resp, m, head, q.avail_flags(write=True))
            q.advance()
        q.slots[head] = 1
        q.put_avail((head, q.avail_flags() | flags))
    return craft


def _too_long(a: Attack, q: RawPackedQueue) -> None:
    """Every descriptor of the ring says NEXT: a list longer than the queue."""
    (req, n, _), _ = _bufs(a, q)
    head, head_flags = q.slot, q.avail_flags(nxt=True)
    for i in range(q.size):
        q.write_desc(q.slot, req, n, head, 0 if i == 0 else q.avail_flags(nxt=True))
        q.advance()
    q.put_avail((head, head_flags))


def _write_then_read(a: Attack, q: RawPackedQueue) -> None:
    (req, n, _), (resp, m, _) = _bufs(a, q)
    q.put_avail(q.add([(resp, m, True), (req, n, False)]))


def _event(off_wrap: int, flags: int) -> Craft:
    def craft(a: Attack, q: RawPackedQueue) -> None:
        q.set_event(off_wrap, flags)
        q.put_avail(q.add(_bufs(a, q)))
    return craft


def _bad_notify_data(a: Attack, q: RawPackedQueue) -> None:
    """A good request, then a notification whose data claims five more descriptors."""
    q.put_avail(q.add(_bufs(a, q)))
    claim = (q.slot + 5) | q.wrap << 15
    a.dev.t.notify_value(q.index, q.index | claim << 16)


def _bad_notify_data_split(a: Attack) -> None:
    """Split ring: the notification claims an avail index three past avail.idx."""
    if not a.dev.bring_up(BASE_FEATURES | DATA):
        raise RuntimeError("bring-up with NOTIFICATION_DATA failed")
    a.probe_features = BASE_FEATURES | DATA
    a.ctx = a.dev.create_context()
    q = a.dev.queues[A.FIRST_SUBMITQ]
    req, resp = _submit_bufs(a)
    q.put_avail(q.add([(req, A.SUBMIT_REQ.size, False), (resp, A.SUBMIT_RESP.size, True)]))
    a.dev.t.notify_value(q.index, q.index | ((q.avail_idx + 3) & 0xFFFF) << 16)
    a.sleep(SETTLE_NS)
    if not a.dev.needs_reset():
        a.breach("notify/data", "no DEVICE_NEEDS_RESET after a notification claiming an "
                                "avail index the ring does not hold")


def _reset_not_enabled(a: Attack) -> None:
    """RING_RESET of submit queue 1, which the driver never enabled."""
    if not a.dev.bring_up(PACKED | RESET, queues=A.FIRST_SUBMITQ + 1):
        raise RuntimeError("bring-up with RING_RESET failed")
    a.probe_features = PACKED | RESET
    a.dev.t.queue_reset(A.FIRST_SUBMITQ + 1)
    a.sleep(SETTLE_NS)
    if not a.dev.needs_reset():
        a.breach("queue/reset-not-enabled", "no DEVICE_NEEDS_RESET after resetting a queue "
                                            "that is not enabled")


def _reset_busy_controlq(a: Attack, q: RawPackedQueue) -> None:
    """A controlq request taken by the device, then a reset of the controlq under it."""
    q.put_avail(q.add(_bufs(a, q)))
    a.dev.t.notify(q.index)
    a.dev.t.queue_reset(q.index)


def catalogue() -> list[Scenario]:
    out = [
        _scenario("avail-used-polarity", "ring/packed-avail-flags",
                  "a descriptor made available with AVAIL = USED = the wrap counter", _polarity),
        _scenario("id-in-flight", "ring/packed-id-in-flight",
                  "a buffer id reused while it is in flight", _id_in_flight,
                  queue=A.CONTROLQ),
        _scenario("id-range", "ring/packed-id-range", "a buffer id beyond the queue size",
                  _id_range),
        _scenario("chain-wraps-flags", "ring/packed-chain-flags",
                  "a list across the ring's end with the old wrap counter's flags",
                  _chain_wraps, queue=A.CONTROLQ),
        _scenario("indirect-with-next", "ring/indirect-next",
                  "an indirect descriptor with NEXT set", _indirect("with-next")),
        _scenario("indirect-nested", "ring/indirect-nested",
                  "an indirect table holding an indirect descriptor", _indirect("nested")),
        _scenario("indirect-bad-len", "ring/indirect-len",
                  "an indirect table of 24 bytes", _indirect("bad-len")),
        _scenario("chain-longer-than-queue", "ring/packed-chain-len",
                  "a list longer than the queue", _too_long),
        _scenario("write-before-read", "ring/write-before-read",
                  "a device-writable descriptor in the readable part", _write_then_read),
        _scenario("event-flags-reserved", "ring/event-flags",
                  "driver event suppression flags with the reserved value 3", _event(0, 3)),
        _scenario("event-flags-reserved-bits", "ring/event-flags",
                  "driver event suppression flags with a reserved bit", _event(0, 0x10)),
        _scenario("event-off-beyond-ring", "ring/event-off-range",
                  "driver event suppression DESC offset beyond the ring",
                  _event(QUEUE_SIZE + 3 | 1 << 15, V.PACKED_EVENT_FLAG_DESC),
                  features=PACKED | EVENT_IDX),
        _scenario("notify-data-beyond-ring", "notify/data",
                  "NOTIFICATION_DATA claiming descriptors the ring does not hold",
                  _bad_notify_data, features=PACKED | DATA, notify=False),
        Scenario("packed/notify-data-split", CAT, "notify/data", _bad_notify_data_split,
                 doc="NOTIFICATION_DATA claiming an avail index past avail.idx (split ring)",
                 device_config=OFFER_ALL),
        Scenario("packed/queue-reset-not-enabled", CAT, "queue/reset-not-enabled",
                 _reset_not_enabled, doc="RING_RESET of a queue that is not enabled",
                 device_config=OFFER_ALL),
        _scenario("queue-reset-busy-controlq", "queue/reset-busy",
                  "RING_RESET of the controlq while a request is in flight",
                  _reset_busy_controlq, features=PACKED | RESET, queue=A.CONTROLQ,
                  notify=False, config=SLOW_CTRL),
    ]
    # vhost-vdpa carries neither a notification's data (an ioeventfd kick is a bare
    # doorbell) nor a per-queue reset: its parent hides both features (vmm/vdpa/parent.py).
    no_vdpa = {"notify/data", "queue/reset-not-enabled", "queue/reset-busy"}
    return [dataclasses.replace(sc, attachments=sc.attachments - {"vdpa"})
            if sc.rule in no_vdpa else sc for sc in out]
