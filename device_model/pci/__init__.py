"""PCI functions of the device model: what a PCI host bridge (the VMM) talks to."""
