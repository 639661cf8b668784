"""A live move of a running guest's vdpa device from one function to another.

Why: a host must be able to take a function away from a tenant (maintenance, a
rebalance, a failing part) without the tenant noticing; vDPA makes that possible
because the VMM owns the control path. The steps are QEMU's for a vhost-vdpa device
migrated in place, on one host:
1. SUSPEND the old device (it finishes what it took from the rings), read every ring's
   base (VHOST_GET_VRING_BASE) and the device state (contexts, device memory) through
   the parent's migration port (the vendor's state path, docs/spec.md §15);
2. create a vdpa device on the target management device, open its vhost-vdpa file,
   IOTLB, features and the state as the old one had them, SET_VRING_BASE and start it;
3. switch the frontend's backend (its irqfds and kick eventfds now reach the new
   function), close the old file and delete the old device;
4. kick every queue: what the guest made available while suspended is taken now.
The guest sees nothing but time passing. A step that fails before 3 resumes the old
device and deletes the new one: the guest carries on where it was.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .frontend import VhostBackend

if TYPE_CHECKING:
    from ..vm import VdpaVa1, Vm


def move(vm: "Vm", attachment: "VdpaVa1", mgmtdev: str, name: str) -> "VdpaVa1":
    """Move `attachment` of `vm` to a new vdpa device `name` on `mgmtdev`; returns the
    attachment (updated in place)."""
    host = attachment.host
    bus = host.vdpa
    frontend = attachment.frontend
    old = attachment.backend
    old_dev = bus.device(attachment.device_name)
    new_dev = bus.dev_add(name, mgmtdev)            # EEXIST/ENODEV/EBUSY: nothing done yet
    bases = old.suspend()
    try:
        migration = old_dev.parent.migration
        new_migration = new_dev.parent.migration
        if migration is None or new_migration is None:
            raise OSError(95, "a parent without a migration port cannot move device state")
        state = migration.save()
        vhost = bus.open(new_dev.vhost_path, [vm.memory], process=vm)
        try:
            new = VhostBackend(vhost, vm.memory, host.eventfds, vm.irqfd(host.eventfds),
                               old.tracer, owner=vm)
        except BaseException:
            vhost.close()
            raise
        try:
            new.bases = bases
            new_migration.load(state)
            new.restore(frontend.acked_features, frontend.status, frontend.queues, frontend)
        except BaseException:
            new.close()
            raise
    except BaseException:
        bus.dev_del(name)
        old.resume()
        raise
    frontend.switch_backend(new).close()
    bus.dev_del(attachment.device_name)
    attachment.device_name = name
    attachment.backend = new
    host.tracer.emit("vdpa_moved", vm=vm.name, to=name, mgmtdev=mgmtdev, bases=str(bases))
    new.kick_all()
    return attachment
