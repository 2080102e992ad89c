"""Reads on the devnet: the storage items (``query`` / ``query_map``) and runtime APIs
(``runtime_call``) the bittensor v11 SDK asks for, answered from the state in the shapes its
decoders expect (u16 fractions, rao amounts, axon records as on subtensor).

An item the devnet does not know is answered empty by :class:`~.substrate.DevnetSubstrate`; an
unknown runtime API raises :class:`~.schema.Refused` (``RuntimeApiNotSupported``).
"""
from __future__ import annotations

from typing import Any, Optional

from .schema import GLOBAL_MAX_SUBNET_COUNT, RAO_PER_TAO, Refused, u16
from .shield import mev_public_key
from .state import DevnetState


def axon_record(ax: Optional[dict]) -> dict:
    if not ax:
        return {"block": 0, "version": 0, "ip": 0, "port": 0, "ip_type": 0, "protocol": 0,
                "placeholder1": 0, "placeholder2": 0}
    return {"block": ax["block"], "version": ax["version"], "ip": ax["ip"], "port": ax["port"],
            "ip_type": ax["ip_type"], "protocol": ax["protocol"], "placeholder1": 0, "placeholder2": 0}


class _View:
    """One consistent read of a subnet (neurons, stake, axons) for the runtime APIs."""

    def __init__(self, st: DevnetState, netuid: int):
        self.st = st
        self.netuid = netuid
        self.sub = st.subnet(netuid)
        self.block = st.block()
        self.neurons = st.neurons(netuid) if self.sub else []
        self.stakes = st.stake_of(netuid) if self.sub else {}
        self.axons = st.axons(netuid) if self.sub else {}
        self._matrices: Optional[tuple[dict, dict]] = None

    def stake(self, hotkey: str) -> int:
        return sum(self.stakes.get(hotkey, {}).values())

    def active(self, nr: dict) -> bool:
        return self.block - int(nr["last_update"]) <= int(self.sub["params"]["activity_cutoff"])

    def neuron_info(self, nr: dict, *, lite: bool) -> dict:
        hk = nr["hotkey"]
        rec = {
            "hotkey": hk, "coldkey": nr["coldkey"], "uid": nr["uid"], "netuid": self.netuid,
            "active": self.active(nr), "axon_info": axon_record(self.axons.get(hk)),
            "prometheus_info": {"block": 0, "version": 0, "ip": 0, "port": 0, "ip_type": 0},
            "stake": sorted(self.stakes.get(hk, {}).items()),
            "rank": u16(nr["rank"]), "emission": int(nr["emission"]), "incentive": u16(nr["incentive"]),
            "consensus": u16(nr["consensus"]), "trust": u16(nr["trust"]),
            "validator_trust": u16(nr["validator_trust"]), "dividends": u16(nr["dividends"]),
            "last_update": int(nr["last_update"]), "validator_permit": bool(nr["validator_permit"]),
            "pruning_score": u16(nr["incentive"]),
        }
        if not lite:
            if self._matrices is None:
                self._matrices = (self.st.weights_rows(self.netuid, "weights"), self.st.weights_rows(self.netuid, "bonds"))
            w = self._matrices[0].get(nr["uid"], [])
            b = self._matrices[1].get(nr["uid"], [])
            rec["weights"] = [(int(j), int(v)) for j, v in w]
            rec["bonds"] = [(int(j), u16(v)) for j, v in b]
        return rec

    def metagraph(self) -> Optional[dict]:
        if self.sub is None:
            return None
        sub, hp = self.sub, self.sub["params"]
        tempo = int(sub["tempo"])
        stakes = [self.stake(nr["hotkey"]) for nr in self.neurons]
        col = lambda key, f=float: [f(nr[key]) for nr in self.neurons]  # noqa: E731
        return {
            "netuid": self.netuid, "name": list(sub["name"].encode()), "symbol": list(sub["symbol"].encode()),
            "identity": None, "network_registered_at": int(sub["registered_at"]),
            "owner_hotkey": sub["owner_hotkey"], "owner_coldkey": sub["owner_coldkey"],
            "block": self.block, "tempo": tempo, "last_step": int(sub["last_epoch_block"]),
            "blocks_since_last_step": self.block - int(sub["last_epoch_block"]),
            "subnet_emission": 0, "alpha_in": RAO_PER_TAO, "alpha_out": 0, "tao_in": RAO_PER_TAO,
            "alpha_out_emission": int(hp["emission_per_block"]), "alpha_in_emission": 0, "tao_in_emission": 0,
            "pending_alpha_emission": 0, "pending_root_emission": 0, "subnet_volume": 0,
            "moving_price": {"bits": 2**32},
            "rho": 10, "kappa": int(hp["kappa"]), "min_allowed_weights": int(hp["min_allowed_weights"]),
            "max_weights_limit": int(hp["max_weights_limit"]), "weights_version": int(hp["weights_version"]),
            "weights_rate_limit": int(hp["weights_rate_limit"]), "activity_cutoff": int(hp["activity_cutoff"]),
            "max_validators": int(hp["max_validators"]), "num_uids": len(self.neurons), "max_uids": int(hp["max_uids"]),
            "burn": int(hp["burn"]), "difficulty": 0, "registration_allowed": bool(hp["registration_allowed"]),
            "pow_registration_allowed": False, "immunity_period": int(hp["immunity_period"]),
            "min_difficulty": 0, "max_difficulty": 0, "min_burn": int(hp["burn"]), "max_burn": int(hp["burn"]),
            "adjustment_alpha": 0, "adjustment_interval": 0, "target_regs_per_interval": 0,
            "max_regs_per_block": int(hp["max_regs_per_block"]), "serving_rate_limit": int(hp["serving_rate_limit"]),
            "commit_reveal_weights_enabled": bool(hp["commit_reveal_weights_enabled"]), "commit_reveal_period": 1,
            "liquid_alpha_enabled": False, "alpha_high": 0, "alpha_low": 0,
            "bonds_moving_avg": int(hp["bonds_moving_avg"]),
            "hotkeys": [nr["hotkey"] for nr in self.neurons], "coldkeys": [nr["coldkey"] for nr in self.neurons],
            "identities": [None] * len(self.neurons),
            "axons": [axon_record(self.axons.get(nr["hotkey"])) for nr in self.neurons],
            "active": [self.active(nr) for nr in self.neurons],
            "validator_permit": [bool(nr["validator_permit"]) for nr in self.neurons],
            "pruning_score": [u16(x) for x in col("incentive")],
            "last_update": col("last_update", int), "emission": col("emission", int),
            "dividends": [u16(x) for x in col("dividends")], "incentives": [u16(x) for x in col("incentive")],
            "consensus": [u16(x) for x in col("consensus")], "trust": [u16(x) for x in col("trust")],
            "rank": [u16(x) for x in col("rank")], "block_at_registration": col("registered_at", int),
            "alpha_stake": stakes, "tao_stake": [0] * len(self.neurons), "total_stake": stakes,
            "tao_dividends_per_hotkey": [], "alpha_dividends_per_hotkey": [],
        }

    def hyperparams_v3(self) -> Optional[list[dict]]:
        if self.sub is None:
            return None
        hp = self.sub["params"]
        table = [
            ("rho", "u16", 10), ("kappa", "u16", hp["kappa"]), ("immunity_period", "u16", hp["immunity_period"]),
            ("min_allowed_weights", "u16", hp["min_allowed_weights"]), ("max_weights_limit", "u16", hp["max_weights_limit"]),
            ("tempo", "u16", self.sub["tempo"]), ("min_difficulty", "u64", 0), ("max_difficulty", "u64", 0),
            ("weights_version", "u64", hp["weights_version"]), ("weights_rate_limit", "u64", hp["weights_rate_limit"]),
            ("adjustment_interval", "u16", 0), ("activity_cutoff", "u16", hp["activity_cutoff"]),
            ("registration_allowed", "bool", bool(hp["registration_allowed"])), ("target_regs_per_interval", "u16", 0),
            ("min_burn", "u64", hp["burn"]), ("max_burn", "u64", hp["burn"]), ("bonds_moving_avg", "u64", hp["bonds_moving_avg"]),
            ("max_regs_per_block", "u16", hp["max_regs_per_block"]), ("serving_rate_limit", "u64", hp["serving_rate_limit"]),
            ("max_validators", "u16", hp["max_validators"]), ("adjustment_alpha", "u64", 0), ("difficulty", "u64", 0),
            ("commit_reveal_period", "u64", 1),
            ("commit_reveal_weights_enabled", "bool", bool(hp["commit_reveal_weights_enabled"])),
            ("alpha_high", "u16", 0), ("alpha_low", "u16", 0), ("liquid_alpha_enabled", "bool", False),
            ("max_uids", "u16", hp["max_uids"]), ("burn", "u64", hp["burn"]),
        ]
        return [{"name": name, "value": {tag: value}} for name, tag, value in table]


def _vec(st: DevnetState, netuid: int, fn) -> Optional[list]:
    if st.subnet(netuid) is None:
        return None
    return [fn(nr) for nr in st.neurons(netuid)]


def _hp(name: str, cast=int):
    def get(st: DevnetState, p: list, block: int):
        sub = st.subnet(int(p[0]))
        return None if sub is None else cast(sub["params"][name])
    return get


def account_info(st: DevnetState, coldkey: str) -> dict:
    row = st._q1("SELECT free, nonce FROM balances WHERE coldkey=?", (str(coldkey),))
    free, nonce = (int(row["free"]), int(row["nonce"])) if row else (0, 0)
    return {"nonce": nonce, "consumers": 0, "providers": 1 if row else 0, "sufficients": 0,
            "data": {"free": free, "reserved": 0, "frozen": 0, "flags": 0}}


def _commitment_value(st: DevnetState, p: list, block: int):
    return st.commitments(int(p[0])).get(str(p[1]))


def _axon_value(st: DevnetState, p: list, block: int):
    ax = st.axons(int(p[0])).get(str(p[1]))
    return None if ax is None else axon_record(ax)


def _weights_value(table: str):
    def get(st: DevnetState, p: list, block: int):
        netuid = int(p[0]) % GLOBAL_MAX_SUBNET_COUNT
        row = st.weights_rows(netuid, table).get(int(p[1]))
        if row is None:
            return []
        return [(int(j), int(v) if table == "weights" else u16(v)) for j, v in row]
    return get


def _float_vec(key: str):
    return lambda st, p, b: _vec(st, int(p[0]), lambda nr: u16(nr[key]))


STORAGE: dict[tuple[str, str], Any] = {
    ("SubtensorModule", "Uids"): lambda st, p, b: st.uid_of(int(p[0]), str(p[1])),
    ("SubtensorModule", "Keys"): lambda st, p, b: next((nr["hotkey"] for nr in st.neurons(int(p[0])) if nr["uid"] == int(p[1])), None),
    ("SubtensorModule", "SubnetworkN"): lambda st, p, b: len(st.neurons(int(p[0]))) if st.subnet(int(p[0])) else 0,
    ("SubtensorModule", "NetworksAdded"): lambda st, p, b: st.subnet(int(p[0])) is not None,
    ("SubtensorModule", "Tempo"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("tempo"),
    ("SubtensorModule", "Burn"): _hp("burn"),
    ("SubtensorModule", "MinBurn"): _hp("burn"),
    ("SubtensorModule", "MaxBurn"): _hp("burn"),
    ("SubtensorModule", "CollateralLockShare"): lambda st, p, b: 0,
    ("SubtensorModule", "CommitRevealWeightsEnabled"): _hp("commit_reveal_weights_enabled", bool),
    ("SubtensorModule", "WeightsSetRateLimit"): _hp("weights_rate_limit"),
    ("SubtensorModule", "WeightsVersionKey"): _hp("weights_version"),
    ("SubtensorModule", "MinAllowedWeights"): _hp("min_allowed_weights"),
    ("SubtensorModule", "MaxWeightsLimit"): _hp("max_weights_limit"),
    ("SubtensorModule", "ImmunityPeriod"): _hp("immunity_period"),
    ("SubtensorModule", "MaxAllowedUids"): _hp("max_uids"),
    ("SubtensorModule", "MaxAllowedValidators"): _hp("max_validators"),
    ("SubtensorModule", "ActivityCutoff"): _hp("activity_cutoff"),
    ("SubtensorModule", "Kappa"): _hp("kappa"),
    ("SubtensorModule", "BondsMovingAverage"): _hp("bonds_moving_avg"),
    ("SubtensorModule", "NetworkRegistrationAllowed"): _hp("registration_allowed", bool),
    ("SubtensorModule", "ServingRateLimit"): _hp("serving_rate_limit"),
    ("SubtensorModule", "MaxRegistrationsPerBlock"): _hp("max_regs_per_block"),
    ("SubtensorModule", "Difficulty"): lambda st, p, b: 0,
    ("SubtensorModule", "RevealPeriodEpochs"): lambda st, p, b: 1,
    ("SubtensorModule", "SubnetEpochConsensus"): lambda st, p, b: "Yuma",
    ("SubtensorModule", "SubnetEmissionEnabled"): lambda st, p, b: 1,
    ("SubtensorModule", "PendingEpochAt"): lambda st, p, b: 0,
    ("SubtensorModule", "LastEpochBlock"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("last_epoch_block"),
    ("SubtensorModule", "SubnetEpochIndex"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("epoch_index"),
    ("SubtensorModule", "BlocksSinceLastStep"): lambda st, p, b: (st.block() - st.subnet(int(p[0]))["last_epoch_block"]) if st.subnet(int(p[0])) else None,
    ("SubtensorModule", "LastMechansimStepBlock"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("last_epoch_block"),
    ("SubtensorModule", "SubnetOwner"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("owner_coldkey"),
    ("SubtensorModule", "SubnetOwnerHotkey"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("owner_hotkey"),
    ("SubtensorModule", "TokenSymbol"): lambda st, p, b: list(((st.subnet(int(p[0])) or {}).get("symbol") or "").encode()),
    ("SubtensorModule", "LastUpdate"): lambda st, p, b: _vec(st, int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, lambda nr: int(nr["last_update"])),
    ("SubtensorModule", "ValidatorPermit"): lambda st, p, b: _vec(st, int(p[0]), lambda nr: bool(nr["validator_permit"])),
    ("SubtensorModule", "Active"): lambda st, p, b: [bool(x) for x in (_View(st, int(p[0])).metagraph() or {}).get("active", [])],
    ("SubtensorModule", "Incentive"): _float_vec("incentive"),
    ("SubtensorModule", "Dividends"): _float_vec("dividends"),
    ("SubtensorModule", "Rank"): _float_vec("rank"),
    ("SubtensorModule", "Trust"): _float_vec("trust"),
    ("SubtensorModule", "Consensus"): _float_vec("consensus"),
    ("SubtensorModule", "ValidatorTrust"): _float_vec("validator_trust"),
    ("SubtensorModule", "Emission"): lambda st, p, b: _vec(st, int(p[0]), lambda nr: int(nr["emission"])),
    ("SubtensorModule", "BlockAtRegistration"): lambda st, p, b: next((int(nr["registered_at"]) for nr in st.neurons(int(p[0])) if nr["uid"] == int(p[1])), None),
    ("SubtensorModule", "Weights"): _weights_value("weights"),
    ("SubtensorModule", "Bonds"): _weights_value("bonds"),
    ("SubtensorModule", "Axons"): _axon_value,
    ("SubtensorModule", "Owner"): lambda st, p, b: (st._q1("SELECT coldkey FROM owners WHERE hotkey=?", (str(p[0]),)) or {"coldkey": None})["coldkey"],
    ("SubtensorModule", "OwnedHotkeys"): lambda st, p, b: [r["hotkey"] for r in st._q("SELECT hotkey FROM owners WHERE coldkey=?", (str(p[0]),))],
    ("SubtensorModule", "IsNetworkMember"): lambda st, p, b: st.uid_of(int(p[1]), str(p[0])) is not None,
    ("SubtensorModule", "TotalHotkeyAlpha"): lambda st, p, b: sum(st.stake_of(int(p[1])).get(str(p[0]), {}).values()),
    ("SubtensorModule", "Alpha"): lambda st, p, b: st.stake_of(int(p[2])).get(str(p[0]), {}).get(str(p[1]), 0),
    ("System", "Account"): lambda st, p, b: account_info(st, str(p[0])),
    ("System", "Number"): lambda st, p, b: b,
    ("Timestamp", "Now"): lambda st, p, b: st.block_timestamp_ms(b),
    ("Commitments", "CommitmentOf"): _commitment_value,
    ("Commitments", "RevealedCommitments"): lambda st, p, b: None,
    ("MevShield", "NextKey"): lambda st, p, b: "0x" + mev_public_key(st).hex(),
}


def _map_netuids(st: DevnetState, fn) -> list[tuple]:
    return [(netuid, fn(st.subnet(netuid))) for netuid in st.netuids()]


def _pending_commits(st: DevnetState, netuid: int) -> list[tuple[int, list]]:
    """``TimelockedWeightCommits``: the commits not revealed yet, as (epoch, [(hotkey, commit block,
    commit, reveal round)]); the epoch is the commit block // (tempo + 1)."""
    tempo = int((st.subnet(netuid) or {}).get("tempo") or 0)
    out: dict[int, list] = {}
    for r in st._q("SELECT * FROM weight_commits WHERE netuid=? AND status='pending' ORDER BY id", (netuid,)):
        out.setdefault(int(r["block"]) // (tempo + 1), []).append(
            (r["hotkey"], int(r["block"]), "0x" + r["commit_hex"], int(r["reveal_round"])))
    return sorted(out.items())


STORAGE_MAPS: dict[tuple[str, str], Any] = {
    ("SubtensorModule", "Uids"): lambda st, p: [(nr["hotkey"], nr["uid"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "Keys"): lambda st, p: [(nr["uid"], nr["hotkey"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "BlockAtRegistration"): lambda st, p: [(nr["uid"], nr["registered_at"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "Weights"): lambda st, p: [(uid, [(int(j), int(v)) for j, v in row]) for uid, row in st.weights_rows(int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, "weights").items()],
    ("SubtensorModule", "Bonds"): lambda st, p: [(uid, [(int(j), u16(v)) for j, v in row]) for uid, row in st.weights_rows(int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, "bonds").items()],
    ("SubtensorModule", "Axons"): lambda st, p: [(hk, axon_record(ax)) for hk, ax in st.axons(int(p[0])).items()],
    ("SubtensorModule", "NetworksAdded"): lambda st, p: _map_netuids(st, lambda s: True),
    ("SubtensorModule", "Tempo"): lambda st, p: _map_netuids(st, lambda s: s["tempo"]),
    ("SubtensorModule", "Burn"): lambda st, p: _map_netuids(st, lambda s: s["params"]["burn"]),
    ("SubtensorModule", "SubnetworkN"): lambda st, p: [(n, len(st.neurons(n))) for n in st.netuids()],
    ("SubtensorModule", "TokenSymbol"): lambda st, p: _map_netuids(st, lambda s: list(s["symbol"].encode())),
    ("SubtensorModule", "SubnetOwner"): lambda st, p: _map_netuids(st, lambda s: s["owner_coldkey"]),
    ("SubtensorModule", "LastEpochBlock"): lambda st, p: _map_netuids(st, lambda s: s["last_epoch_block"]),
    ("SubtensorModule", "IsNetworkMember"): lambda st, p: [(n, True) for n in st.netuids() if st.uid_of(n, str(p[0])) is not None],
    ("SubtensorModule", "TotalHotkeyAlpha"): lambda st, p: [(n, sum(st.stake_of(n).get(str(p[0]), {}).values())) for n in st.netuids()],
    ("SubtensorModule", "Owner"): lambda st, p: [(r["hotkey"], r["coldkey"]) for r in st._q("SELECT * FROM owners")],
    ("Commitments", "CommitmentOf"): lambda st, p: list(st.commitments(int(p[0])).items()),
    ("Commitments", "RevealedCommitments"): lambda st, p: [],
    ("SubtensorModule", "TimelockedWeightCommits"): lambda st, p: _pending_commits(st, int(p[0]) % GLOBAL_MAX_SUBNET_COUNT),
    ("SubtensorModule", "SubnetEmaTaoFlow"): lambda st, p: [],
}


def runtime(st: DevnetState, api: str, method: str, params: list) -> Any:
    if api == "NeuronInfoRuntimeApi":
        view = _View(st, int(params[0]))
        if view.sub is None:
            return [] if method.startswith("get_neurons") else None
        lite = method.endswith("_lite")
        if method in ("get_neurons", "get_neurons_lite"):
            return [view.neuron_info(nr, lite=lite) for nr in view.neurons]
        if method in ("get_neuron", "get_neuron_lite"):
            nr = next((nr for nr in view.neurons if nr["uid"] == int(params[1])), None)
            return None if nr is None else view.neuron_info(nr, lite=lite)
    if api == "SubnetInfoRuntimeApi":
        if method == "get_metagraph":
            return _View(st, int(params[0])).metagraph()
        if method == "get_all_metagraphs":
            return [_View(st, n).metagraph() for n in st.netuids()]
        if method in ("get_subnet_hyperparams_v3",):
            return _View(st, int(params[0])).hyperparams_v3()
        if method in ("get_subnet_hyperparams", "get_subnet_hyperparams_v2"):
            entries = _View(st, int(params[0])).hyperparams_v3()
            return None if entries is None else {e["name"]: next(iter(e["value"].values())) for e in entries}
        if method == "get_next_epoch_start_block":
            sub = st.subnet(int(params[0]))
            if sub is None:
                return None
            b = st.block()
            return DevnetState.last_epoch_at_or_before(b, int(params[0]), sub["tempo"]) + sub["tempo"] + 1
    raise Refused("RuntimeApiNotSupported", f"the devnet does not implement runtime API {api}.{method}")
