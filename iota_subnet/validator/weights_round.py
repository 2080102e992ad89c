"""Setting the validator's weights on chain: every tempo (``max(tempo, weights_rate_limit)`` blocks
after the last set), with the weights version key, confirmed from the chain's state, and with
commit-reveal recorded only once the chain has revealed them (:mod:`.reveals`)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from loguru import logger

from iota_subnet.chain import ChainError
from iota_subnet.version import __version__

from .options import ChainOptions, ValidatorError
from .reveals import PendingReveals

#: what records weights the chain shows as set: (block, uids, weights)
Recorder = Callable[[int, list[int], list[float]], None]


class WeightsRound:
    """The weights this validator set (:attr:`weights_blocks`, :attr:`last_weights`) and those it
    committed and awaits the reveal of (:attr:`reveals`); ``opts``: netuid and version key."""

    def __init__(self, opts: ChainOptions):
        self.opts = opts
        self.weights_blocks: list[int] = []
        self.last_weights: dict[int, float] = {}
        self.reveals = PendingReveals()      # commit-reveal: commits not yet seen revealed
        self.tempo = 0
        self.rate_limit = 0

    def set_timing(self, hp: dict, tempo: int) -> None:
        """The subnet's tempo and weights rate limit (hyperparameters ``hp``)."""
        self.tempo = tempo
        self.rate_limit = int(hp.get("weights_rate_limit", 0) or 0)

    def check_version_key(self, hp: dict, log: bool = True) -> None:
        """Stop when the subnet requires a newer weights version key than this release sends
        (at start and before every set of weights). Raises :class:`ValidatorError`."""
        required = int(hp.get("weights_version", 0) or 0)
        key = self.opts.version_key
        if key < required:
            raise ValidatorError(
                f"this validator (iota-subnet {__version__}) sends weights version key {key}, but "
                f"netuid {self.opts.netuid} requires weights_version {required}: the subnet moved to a newer release. "
                "Update (git pull && make setup) and restart; the chain refuses weights with an older key")
        if key > required and log:
            logger.info("weights version key {} (iota-subnet {}); the subnet requires at least {}",
                        key, __version__, required)

    async def maybe_set(self, chain: Any, wallet: Any, uid: int, prepare: Callable[[int], Awaitable[dict[int, float]]],
                        record: Recorder) -> bool:
        """Set weights if a tempo (and the rate limit) has passed since the last set. True if set.

        The subnet's weights version is checked first (raises :class:`ValidatorError`, as at start,
        when it rose above this release's key); ``prepare(block)`` then gives the weights (uid ->
        weight; empty: none to set), from the uid owners re-read just before (a uid that changed
        hands since it was scored gets nothing). The weights count as set (``record``) only once the
        chain's state shows them (the hotkey's ``last_update`` reached the extrinsic's block);
        otherwise the next check retries. With commit-reveal, committed weights count as set once
        the chain has revealed them (a True may confirm an earlier commit)."""
        hotkey = wallet.hotkey.ss58_address
        confirmed = await self._confirm_reveals(chain, hotkey, uid, record)
        block = await chain.block()
        last = max(self.weights_blocks[-1:] + [b for b in (self.reveals.last_block(),) if b is not None], default=None)
        every = max(self.tempo, self.rate_limit, 1)
        if last is not None and block - last < every:
            return confirmed
        self.check_version_key(await chain.hyperparameters(self.opts.netuid), log=False)
        weights = await prepare(block)
        if not weights:
            return confirmed
        uids = sorted(weights)
        vals = [weights[u] for u in uids]
        try:
            receipt = await chain.set_weights(wallet, self.opts.netuid, uids, vals, version_key=self.opts.version_key)
        except ChainError as e:
            logger.warning("set_weights refused at block {}: {}", block, e)
            return confirmed
        if not await chain.weights_landed(hotkey, self.opts.netuid, receipt):
            logger.warning("set_weights at block {}: the chain reported success but its state does not show the "
                           "weights (last_update is older than block {}); not recorded, retrying", block, receipt.block)
            return confirmed
        if receipt.commit_reveal:
            self.reveals.add(receipt, dict(zip(uids, vals)), self.last_weights)
            logger.info("weights committed at block {} for reveal at drand round {}; recorded once revealed",
                        receipt.block, receipt.reveal_round)
            return confirmed
        self._record(receipt.block, uids, vals, record)
        return True

    async def _confirm_reveals(self, chain: Any, hotkey: str, uid: int, record: Recorder) -> bool:
        """Record the committed weights the chain now shows revealed (True if any). A commit the chain
        refused at its reveal is dropped with a warning, and the weights version is checked again (a
        raised version makes the chain refuse reveals: stop). See :mod:`.reveals`."""
        if not self.reveals.due():
            return False
        pending = await chain.pending_commits(hotkey, self.opts.netuid)
        row = dict(await chain.weights(self.opts.netuid)).get(uid)
        revealed, refused = self.reveals.resolve(pending, row)
        for c in refused:
            logger.warning("weights committed at block {} (drand round {}) were not revealed: the chain refused "
                           "them at the reveal or dropped them; not recorded as set", c.receipt.block,
                           c.receipt.reveal_round)
        if refused:
            self.check_version_key(await chain.hyperparameters(self.opts.netuid), log=False)
        if revealed is None:
            return False
        self._record(revealed.receipt.block, list(revealed.weights), list(revealed.weights.values()), record)
        return True

    def _record(self, block: int, uids: list[int], vals: list[float], record: Recorder) -> None:
        """Weights the chain shows as set at ``block``: into the status, ``record`` (the state) and the log."""
        self.weights_blocks.append(block)
        self.last_weights = dict(zip(uids, vals))
        record(block, uids, vals)
        logger.info("weights set at block {}: {}", block, {u: round(w, 4) for u, w in zip(uids, vals)})
