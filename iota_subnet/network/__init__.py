"""Running a whole network: the one-machine local network (``localnet``)."""
