"""A whole p2p network in one process without HTTP: ``stages`` x ``replicas`` real StageWorkers behind
real :class:`~iota_subnet.miner.dataplane_http.DataPlaneNode` s on one in-process data-plane transport
(:class:`~iota_subnet.miner.dataplane.transport.InProcessDataPlaneTransport`), and the validator's real
:class:`~iota_subnet.validator.control.ControlPlane` on an in-process control transport of the same
network (:class:`~iota_subnet.validator.control_transport.InProcessControlTransport`): its tickets reach
the heads' ``/tickets`` route and the miners' receipts and refusal reports its ``/receipts`` and
``/refusals`` handlers, all through the wire codec. The model and the text are those of
:mod:`support.dataplane_net` (tiny 3-stage model, wikitext-2 validation text); no chain, no signatures
on requests (tickets are still signed and checked)."""
from __future__ import annotations

from pathlib import Path

from iota_subnet.config import load_config
from iota_subnet.miner.dataplane import DataPlaneTunables
from iota_subnet.miner.dataplane.transport import InProcessDataPlaneTransport
from iota_subnet.miner.hop_store import HopStore
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.validator.control import ControlOptions, ControlPlane
from iota_subnet.validator.control_transport import InProcessControlTransport
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger
from support.dataplane_net import OVR, RUN, dataset
from support.inprocess_dataplane import inprocess_node, keypair, neurons


class InProcessNet:
    """``stages`` x ``replicas`` miners (``nodes[(stage, replica)]``, their ``keys`` and ``workers``) and
    the validator key ``vali``, all registered in one metagraph view; ``net`` is the shared
    in-process network (``net.kill(hotkey)``: a miner goes away). Replica ``r`` of every stage is lane
    ``r``'s member. ``receipt_interval_s``: the miners' receipt flush period."""

    def __init__(self, wikitext: Path, cache: Path, *, replicas: int = 2, receipt_interval_s: float = 0.1):
        self.cfg = load_config("configs/tiny.yaml", OVR)
        self.ds = dataset(self.cfg, wikitext, cache)
        self.stages, self.replicas = self.cfg.pipeline.stages, replicas
        self.net = InProcessDataPlaneTransport()
        self.vali = keypair("inproc-vali")
        self.keys = {(s, r): keypair(f"inproc-m{s}{r}") for r in range(replicas) for s in range(self.stages)}
        self.metagraph = neurons([self.vali.ss58_address], [k.ss58_address for k in self.keys.values()])
        self.workers = {k: StageWorker(self.cfg, k[0], seed=0) for k in self.keys}
        self.nodes = {k: inprocess_node(self.net, w, self.keys[k], self.cfg, run_id=RUN, stage=k[0],
                                        metagraph=self.metagraph, rows=self._rows(k[0]),
                                        tunables=DataPlaneTunables(receipt_interval_s=receipt_interval_s),
                                        hops=HopStore(2)) for k, w in self.workers.items()}

    def _rows(self, stage: int):
        """What a MinerService of ``stage`` reads: the head the inputs, the tail the targets (None between)."""
        if stage == 0:
            return self.ds.split_batch
        return self.ds.target_batch if stage == self.stages - 1 else None

    def hotkey(self, stage: int, replica: int) -> str:
        return self.keys[(stage, replica)].ss58_address

    def start(self) -> None:
        for n in self.nodes.values():
            n.start()

    def control(self, **opts) -> ControlPlane:
        """The validator's control plane driving every lane (``opts``: more
        :class:`~iota_subnet.validator.control.ControlOptions`), its routes served on the network."""
        router = Router(self.stages)
        router.update({s: [Replica(uid=1 + s * self.replicas + r, hotkey=self.hotkey(s, r), endpoint="in-process",
                                   stage=s) for r in range(self.replicas)] for s in range(self.stages)})
        cp = ControlPlane(self.cfg, router=router, keypair=self.vali, dataset=self.ds,
                          ledger=Ledger([1.0] * self.stages),
                          opts=ControlOptions(run_id=RUN, n_lanes=self.replicas, tag="inproc", **opts),
                          transport=InProcessControlTransport(self.net, self.vali.ss58_address))
        cp.transport.serve(cp.routes())
        return cp

    async def close(self) -> None:
        for n in self.nodes.values():
            await n.stop()
