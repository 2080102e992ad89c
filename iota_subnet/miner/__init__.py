"""Miner logic: the stage worker (compute) and the activation cache; the HTTP service wraps them."""
from iota_subnet.miner.activation_cache import ActivationCache
from iota_subnet.miner.stage_worker import StageWorker, UnknownMicrobatch

__all__ = ["ActivationCache", "StageWorker", "UnknownMicrobatch"]
