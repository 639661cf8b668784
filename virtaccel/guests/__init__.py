"""Guest programs: user programs run inside VMs, on the public runtime API and uAPI."""
