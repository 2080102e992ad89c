"""Simulation: what runs a network that is not the real one, for tests, benchmarks and local networks.

:mod:`.adversary` (the cheater suite: subclasses of a miner's production parts), :mod:`.emulated`
(emulated accelerators), :mod:`.chaos` (fault injection for a local network) and :mod:`.netns`
(kernel-shaped links in network namespaces). Production code never imports this package; only entry
points (the miner's and localnet's command lines), scripts and tests do, and hand its parts to a
:class:`~iota_subnet.miner.service.MinerService` through :class:`~iota_subnet.miner.parts.MinerParts`.
"""
