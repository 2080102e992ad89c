"""Subcommands ``chain metagraph`` and ``register`` of ``iota-subnet`` (an entry point: with
``--chain-db`` they open the devnet file, through :func:`iota_subnet.entry.chain.open_network_chain`)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def _cmd_metagraph(a: argparse.Namespace) -> int:
    from iota_subnet.chain import metagraph_json
    from iota_subnet.entry.chain import open_network_chain

    async def go():
        if a.chain_db:
            if not Path(a.chain_db).exists():
                from iota_subnet.chain import ChainError
                raise ChainError(f"devnet file {a.chain_db} does not exist; start one with `iota-subnet localnet`")
            chain = await open_network_chain("devnet", a.chain_db, timeout_s=a.chain_timeout)
        else:
            chain = await open_network_chain(a.network, timeout_s=a.chain_timeout)
        try:
            return await metagraph_json(chain, a.netuid)
        finally:
            await chain.close()
    rows = asyncio.run(go())
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ["uid", "hotkey", "stake", "validator_permit", "incentive", "dividends", "emission", "axon", "last_update"]
    def cell(c, v):
        if c == "hotkey":
            return str(v)[:10]
        return str(round(v, 5) if isinstance(v, float) else v)
    table = [cols] + [[cell(c, r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    return 0


def _cmd_register(a: argparse.Namespace) -> int:
    from iota_subnet.chain import RegistrationCostError
    from iota_subnet.entry.chain import open_network_chain
    from iota_subnet.wallets import load_wallet

    wallet = load_wallet(a.wallet_name, a.wallet_hotkey, a.wallet_path)
    if a.network is None:
        a.network = "devnet" if a.chain_db else "finney"

    async def go():
        chain = await open_network_chain(a.network, a.chain_db, timeout_s=a.chain_timeout)
        try:
            hk = wallet.hotkey.ss58_address
            uid = await chain.uid(hk, a.netuid)
            if uid is not None:
                print(f"hotkey {hk} is already registered on netuid {a.netuid} as uid {uid}")
                return 0
            cost = await chain.registration_cost(a.netuid)
            print(f"registering hotkey {hk} on netuid {a.netuid} ({a.network}) burns {cost:.9f} TAO "
                  f"from coldkey {wallet.coldkeypub.ss58_address}")
            if a.max_burn is not None and cost > a.max_burn:
                print(f"refusing: the burn is above --max-burn {a.max_burn:.9f} TAO; nothing was paid")
                return 2
            if a.yes:
                accepted = cost if a.max_burn is None else a.max_burn
            else:
                if not sys.stdin.isatty():
                    print("refusing to pay without confirmation: pass --yes (and --max-burn TAO to bound the price)")
                    return 2
                if input("proceed? [y/N] ").strip().lower() not in ("y", "yes"):
                    print("cancelled")
                    return 1
                accepted = cost
            # the chain refuses the registration if the burn rose above what was accepted (register_limit)
            try:
                reg = await chain.register(wallet, a.netuid, max_cost_tao=accepted)
            except RegistrationCostError as e:
                print(f"not registered: {e}")
                return 2
            print(f"registered: uid {reg.uid} ({reg.cost_tao:.9f} TAO burned)")
            return 0
        finally:
            await chain.close()
    return asyncio.run(go())


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chain", help="chain reads")
    csub = c.add_subparsers(dest="chain_command", required=True)
    m = csub.add_parser("metagraph", help="print the metagraph of a subnet")
    m.add_argument("--chain-db", default=None, help="devnet SQLite file (else --network)")
    m.add_argument("--network", default="finney", help="used when no --chain-db is given")
    m.add_argument("--netuid", type=int, default=9)
    m.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    m.add_argument("--chain-timeout", type=float, default=30.0, help="seconds to wait for the chain's answers")
    m.set_defaults(func=_cmd_metagraph)

    r = sub.add_parser("register", help="burned registration of a hotkey (shows the cost first)")
    r.add_argument("--wallet-name", default="default")
    r.add_argument("--wallet-hotkey", default="default")
    r.add_argument("--wallet-path", default="~/.bittensor/wallets")
    r.add_argument("--network", default=None, help="finney | test | local | ws://... | devnet "
                   "(default: devnet with --chain-db, else finney)")
    r.add_argument("--chain-db", default=None, help="devnet SQLite file")
    r.add_argument("--netuid", type=int, default=9)
    r.add_argument("--yes", action="store_true", help="pay without asking (the price shown, or up to --max-burn)")
    r.add_argument("--max-burn", type=float, default=None, metavar="TAO",
                   help="the most TAO to burn; the chain refuses the registration above it")
    r.add_argument("--chain-timeout", type=float, default=60.0, help="seconds to wait for the chain's answers")
    r.set_defaults(func=_cmd_register)
