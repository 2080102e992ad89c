"""A neuron's registration at start: only when asked, never above the price the operator accepted."""
from __future__ import annotations

from typing import Any, Optional

from loguru import logger

from .interface import Chain, NotRegisteredError, RegistrationCostError


async def ensure_registered(chain: Chain, wallet: Any, netuid: int, *, register: bool = False,
                            max_burn_tao: Optional[float] = None) -> int:
    """The wallet hotkey's uid on ``netuid``.

    An unregistered hotkey is registered only with ``register`` (``--register``), and only when the
    burn is at most ``max_burn_tao`` (``--max-burn``): the chain itself refuses the registration if
    the burn rises above that before inclusion (``register_limit``). Raises
    :class:`NotRegisteredError` (with the commands that fix it) or :class:`RegistrationCostError`
    (the cost, and how to accept it); nothing is paid then.
    """
    hotkey = wallet.hotkey.ss58_address
    uid = await chain.uid(hotkey, netuid)
    if uid is not None:
        return uid
    if not register:
        raise NotRegisteredError(
            f"hotkey {hotkey} is not registered on netuid {netuid} ({chain.network}); register it with "
            f"`iota-subnet register --netuid {netuid} ...` (shows the burn and asks), or start with "
            "--register --max-burn TAO to register at most at that price", "HotKeyNotRegisteredInSubNet")
    cost = await chain.registration_cost(netuid)
    if max_burn_tao is None:
        raise RegistrationCostError(f"registering hotkey {hotkey} on netuid {netuid} burns {cost:.9f} TAO now; pass "
                                    f"--max-burn {cost:.9f} (or more) to accept paying up to that", "NoPriceAccepted")
    if cost > max_burn_tao:
        raise RegistrationCostError(f"registering on netuid {netuid} burns {cost:.9f} TAO now, above --max-burn "
                                    f"{max_burn_tao:.9f}; nothing was paid", "RegistrationPriceLimitExceeded")
    logger.info("registering hotkey {} on netuid {}: burns {:.9f} TAO (accepted up to {:.9f})", hotkey, netuid,
                cost, max_burn_tao)
    return (await chain.register(wallet, netuid, max_cost_tao=max_burn_tao)).uid
