"""A validator's control plane against scripted peers: a lane head that never completes, a test clock."""
from __future__ import annotations

from types import SimpleNamespace

from bittensor.sp_core import Keypair

from iota_subnet.config import load_config
from iota_subnet.protocol import Health, Ticket, TicketAck
from iota_subnet.validator.control import ControlOptions, ControlPlane
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger
from support.dataplane_net import OVR


class StuckHead:
    """Every miner of the lane, as the validator sees them: tickets are queued, nothing completes;
    the head reports inner step ``head_step``."""

    def __init__(self, head_step: int):
        self.head_step = head_step
        self.batches: list[tuple[list[Ticket], dict]] = []

    async def call(self, endpoint, hotkey, path, msg, resp_type, **kw):
        if path == "/tickets":
            self.batches.append(([Ticket.from_json(t) for t in msg.tickets], dict(msg.base_steps)))
            return TicketAck(run_id=msg.run_id, accepted=len(msg.tickets))
        if path == "/health":
            return Health(run_id=msg.run_id, stage=msg.stage, inner_step=self.head_step)
        raise AssertionError(f"unexpected call {path}")


def control(head: StuckHead, *, validator_index: int = 0, n_validators: int = 1) -> ControlPlane:
    cfg = load_config("configs/tiny.yaml", OVR)
    router = Router(cfg.pipeline.stages)
    router.update({s: [Replica(uid=s + 1, hotkey=Keypair.create_from_uri(f"//m{s}").ss58_address,
                               endpoint=f"127.0.0.1:{9000 + s}", stage=s)] for s in range(cfg.pipeline.stages)})
    opts = ControlOptions(run_id="stall", n_lanes=1, validator_index=validator_index, n_validators=n_validators,
                          stall_s=0.5, min_stall_s=0.5, turn_timeout_s=60.0, max_attempts=4, reissue_backoff_s=0.01)
    return ControlPlane(cfg, router=router, client=head, keypair=Keypair.create_from_uri("//vali"),
                        dataset=SimpleNamespace(n_val_rows=8), ledger=Ledger([1.0, 1.0, 1.0]), opts=opts)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
