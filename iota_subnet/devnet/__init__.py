"""Devnet: a small Bittensor-like chain whose whole state is ONE SQLite file.

Every process of a local network (miners, validators, CLI) opens the same file through
:class:`DevnetSubstrate`, an implementation of the bittensor v11 SDK's ``Substrate`` protocol
(``bittensor/_substrate.py``), injected into the SDK client of :mod:`iota_subnet.chain`
(:func:`open_devnet`: ``open_chain("devnet", substrate=...)``). The SDK's own reads
(``subnets.metagraph``, ``neurons.all``, ``neurons.uid``, ``weights.weights`` / ``bonds``,
hyperparameters, ...) and writes (``execute(SetWeights)``, ``execute(ServeAxon)``,
``submit_call(burned_register / add_stake / set_commitment)``) then run unmodified. Only entry
points (the CLI, the localnet, the neurons' mains) and tests import this package.

Design
    * No server process. The file is opened in WAL mode with a busy timeout; every write is a
      ``BEGIN IMMEDIATE`` transaction, so concurrent processes serialise on the write lock
      (:mod:`.state`; tables in :mod:`.schema`).
    * Block height follows the wall clock: ``block = floor((now - genesis_time) / block_time)``.
      State has no history: a read pinned to an older block hash sees the current state
      (only ``Timestamp.Now`` honours the pinned block).
    * Extrinsics apply immediately (the "inclusion" is the current block) and are checked the
      way subtensor checks them (registration, version key, rate limits, permits, ...); a
      refused call returns a failed ``ExtrinsicResult`` carrying the chain's error name
      (:mod:`.calls`, :mod:`.weights`).
    * Epochs: subtensor runs a subnet's epoch at blocks where
      ``(block + netuid + 1) % (tempo + 1) == 0``. Whichever process first touches the chain
      after such a block runs Yuma (:mod:`.yuma`, :mod:`.epoch`) inside a write transaction
      guarded by ``last_epoch_block``, so each boundary runs exactly once across processes.
      Missed boundaries (nobody was reading) are folded into one run whose emission covers
      all blocks since the previous run.
    * Stake is alpha on the subnet, 1 TAO = 1 alpha (no AMM). Emission is staked to the
      earning hotkey under its owning coldkey.
    * Signed calls are signed and verified with the caller's keypair (sr25519), so only the
      holder of a key can act for it.

    * Rate limits as on the live chain: ``serving_rate_limit`` blocks between two ``serve_axon``
      of a hotkey (``ServingRateLimitExceeded``), ``weights_rate_limit`` blocks between weight
      sets or commits (``SettingWeightsTooFast`` / ``CommittingWeightsTooFast``), and the
      commitments pallet's space quota: every ``set_commitment`` uses at least 100 bytes of
      ``commitment_max_space`` (``MaxSpace``, 3100) per hotkey and epoch (``SpaceLimitExceeded``).
    * MEV shield (:mod:`.shield`): ``NextKey`` holds an ML-KEM-768 public key (``mev_next_key``); a
      ``MevShield.submit_encrypted`` carrier is decrypted (ML-KEM-768 + XChaCha20-Poly1305, the
      SDK's ``encrypt_mlkem768`` format) and its inner extrinsic applied in the same block, so the
      SDK's shielded path (``execute(BurnedRegister)``, ``submit_call(..., shielded=True)``)
      runs unmodified; ``find_extrinsic`` returns the inner receipt. With the hyperparameter
      ``registration_requires_shield`` the devnet refuses registrations submitted in the clear.
      ``register_limit`` refuses (``RegistrationPriceLimitExceeded``) when the burn is above the
      signer's ``limit_price``.
    * Commit-reveal (hyperparameter ``commit_reveal_weights_enabled``): the SDK's ``SetWeights``
      then submits a drand-timelocked commit (``commit_timelocked_mechanism_weights``); it is
      stored, and once the drand round it names has passed (wall clock, quicknet) it is revealed
      through the state's ``decryptor`` (:func:`drand_decryptor` of :mod:`.tlock` by default, which needs the drand
      HTTP API; tests pass their own) and applied as weights, as subtensor does each block.

Admin helpers outside the SDK (:mod:`.admin`): :func:`create_devnet`, :func:`fund`,
:func:`add_stake`, :func:`halt_devnet`, :func:`resume_devnet`, :func:`set_hyperparameter`,
:func:`seed_neurons`, :func:`epoch_log`.
"""
from __future__ import annotations

from .admin import (add_stake, create_devnet, epoch_log, fund, halt_devnet, resume_devnet, seed_neurons,
                    set_hyperparameter)
from .connect import metagraph_rows, open_devnet
from .schema import DEFAULT_HYPERPARAMS, DevnetCall, DevnetError
from .state import DevnetState
from .substrate import DevnetSubstrate
from .tlock import Decryptor, RevealedWeights, decode_tlock_payload, drand_decryptor

__all__ = [
    "DevnetSubstrate", "DevnetState", "DevnetCall", "DevnetError", "DEFAULT_HYPERPARAMS", "Decryptor",
    "RevealedWeights", "decode_tlock_payload", "drand_decryptor", "open_devnet", "metagraph_rows",
    "create_devnet", "fund", "add_stake", "halt_devnet", "resume_devnet", "set_hyperparameter", "seed_neurons",
    "epoch_log",
]
