"""Entry points: the miner's and validator's command lines (``iota-subnet miner``, ``neurons/*.py``).

They parse flags, open the chain named by ``--network`` (the devnet only here and in the local-network and
chain CLIs) and build the services, passing simulation parts (:mod:`iota_subnet.sim`: adversaries, emulated
accelerators) through :class:`~iota_subnet.miner.parts.MinerParts`. Production packages never import this
package, :mod:`iota_subnet.sim` or :mod:`iota_subnet.devnet` (``.importlinter``)."""
