"""Join a run by its spec hash: find the validators that advertise it on chain, fetch the spec from one,
check it, cache it (:func:`fetch_run_spec`).

The run's validators advertise the hash in their commitments (``h``, :mod:`iota_subnet.protocol.commitment`)
and serve the spec text on ``GET /run/spec`` (:mod:`iota_subnet.protocol.run_spec`). The fetched text is
refused unless its sha256 is the hash (:class:`~iota_subnet.protocol.run_spec.SpecHashMismatchError`,
naming both hashes), then written atomically to ``<cache>/runs/<hash>.yaml`` (a cached copy is checked
the same way before it is used, and fetched again when it does not match). The run id and epoch are
those the advertising validators publish, so a neuron given the hash joins that run and no other one
sharing the chain.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp
from loguru import logger

from iota_subnet.chain import Chain
from iota_subnet.errors import UserError
from iota_subnet.protocol.commitment import VALIDATOR, RunCommitment
from iota_subnet.protocol.run_spec import (MAX_SPEC_BYTES, SPEC_ROUTE, SpecHashMismatchError, check_spec_hash,
                                           verify_spec)
from iota_subnet.utils.atomic import atomic_write_bytes


class RunNotFoundError(UserError):
    """No validator on the subnet advertises the spec hash, or none that does could serve its spec."""


@dataclass(frozen=True)
class AdoptedRun:
    """A run found by its spec hash: ``path`` the checked spec (a config file ``load_config`` reads),
    ``run_id`` / ``run_epoch`` what its validators publish, ``validators`` their uids."""

    spec_hash: str
    path: Path
    run_id: str
    run_epoch: int
    validators: tuple[int, ...]


def advertisers(graph: Any, commitments: dict[str, str], spec_hash: str) -> list[tuple[int, str, RunCommitment]]:
    """(uid, ``host:port``, commitment) of the validators (a validator permit and role ``v``, as
    :meth:`iota_subnet.miner.chain_view.ChainView.run_fingerprints` counts them) whose commitment
    advertises ``spec_hash`` and who serve an address, by uid."""
    out = []
    for n in graph.neurons:
        c = RunCommitment.decode(commitments.get(n.hotkey))
        ep = n.axon
        if c is None or c.role != VALIDATOR or c.spec_hash != spec_hash or not n.validator_permit or not ep \
                or ep.startswith("0.0.0.0:"):
            continue
        out.append((int(n.uid), ep, c))
    return sorted(out, key=lambda t: t[0])


def the_run(found: list[tuple[int, str, RunCommitment]], graph: Any, commitments: dict[str, str],
            spec_hash: str) -> tuple[str, int]:
    """The (run id, epoch) the advertisers of ``spec_hash`` publish (the most common). Raises
    :class:`UserError` when a validator (with a permit) publishes that run id and epoch with another spec
    hash: two runs share the id, and a neuron could not tell their neurons apart."""
    runs = Counter((c.run, c.epoch) for _, _, c in found)
    (run, epoch), _ = runs.most_common(1)[0]
    if len(runs) > 1:
        logger.warning("validators advertise spec {} under several runs {}; joining {!r} epoch {}", spec_hash[:12],
                       sorted(runs), run, epoch)
    for n in graph.neurons:
        c = RunCommitment.decode(commitments.get(n.hotkey)) if n.validator_permit else None
        if c is not None and c.role == VALIDATOR and c.same_run(run, epoch) and c.spec_hash not in ("", spec_hash):
            raise UserError(f"run {run!r} epoch {epoch} is advertised with two spec hashes, {spec_hash} and "
                            f"{c.spec_hash}: two runs share one run id; their validators must use distinct --run-id")
    return run, epoch


async def _get(endpoint: str, timeout_s: float) -> bytes:
    """The whole body of ``GET http://<endpoint>/run/spec``, or its first pieces once past MAX_SPEC_BYTES
    (then at most MAX_SPEC_BYTES + 64 KiB; :func:`verify_spec` refuses it). Read piece by piece until the
    end: one ``read(n)`` returns only what has arrived, which truncated a spec sent in several pieces. A
    redirect is not followed (``ClientResponseError``: the advertiser is skipped), so an advertiser cannot
    point the reader at another address."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"http://{endpoint}{SPEC_ROUTE}", allow_redirects=False) as r:     # its own answer only
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=r.reason or "")
            body = bytearray()
            async for piece in r.content.iter_chunked(64 << 10):
                body += piece
                if len(body) > MAX_SPEC_BYTES:
                    break
            return bytes(body)


def _cached(path: Path, spec_hash: str) -> bool:
    """True when ``path`` holds the spec of ``spec_hash``; a copy that does not match is set aside."""
    if not path.exists():
        return False
    try:
        verify_spec(path.read_bytes(), spec_hash, str(path))
        return True
    except (OSError, SpecHashMismatchError) as e:
        logger.warning("cached run spec {} is unusable ({}); fetching it again", path, e)
        return False


async def fetch_run_spec(chain: Chain, netuid: int, spec_hash: str, cache_dir: Path, *,
                         timeout_s: float = 10.0) -> AdoptedRun:
    """The run that ``spec_hash`` addresses on ``netuid`` (see the module docstring). Its spec is read
    from ``cache_dir/runs/<hash>.yaml`` when that copy matches, else from the advertising validators in
    uid order (each within ``timeout_s`` seconds) until one serves text that hashes to it.

    Raises :class:`UserError` for a malformed hash or two runs under one id, :class:`RunNotFoundError`
    when no validator advertises the hash or none of them answers, :class:`SpecHashMismatchError` (naming
    the hash wanted and the one served) when every validator that answered served other content."""
    spec_hash = check_spec_hash(spec_hash)
    graph = await chain.metagraph(netuid)
    commitments = dict(await chain.commitments(netuid))
    found = advertisers(graph, commitments, spec_hash)
    if not found:
        seen = sorted({c.spec_hash[:12] for c in map(RunCommitment.decode, commitments.values())
                       if c is not None and c.role == VALIDATOR and c.spec_hash})
        raise RunNotFoundError(f"no validator on netuid {netuid} advertises spec hash {spec_hash} (advertised: "
                               f"{', '.join(seen) or 'none'}); start the run's validators first, or check the hash")
    run, epoch = the_run(found, graph, commitments, spec_hash)
    path = Path(cache_dir) / "runs" / f"{spec_hash}.yaml"
    uids = tuple(u for u, _, c in found if c.same_run(run, epoch))
    if not _cached(path, spec_hash):
        mismatch: Optional[SpecHashMismatchError] = None
        unreachable = []
        for uid, ep, c in found:
            if not c.same_run(run, epoch):
                continue
            try:
                body = await _get(ep, timeout_s)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                unreachable.append(f"uid {uid} ({ep}): {type(e).__name__} {e}".strip())
                continue
            try:
                verify_spec(body, spec_hash, f"validator uid {uid} ({ep})")
            except SpecHashMismatchError as e:
                logger.error(str(e))
                mismatch = mismatch or e
                continue
            atomic_write_bytes(path, body)
            logger.info("run spec {} fetched from validator uid {} ({}) and checked: {}", spec_hash[:12], uid, ep, path)
            break
        else:
            if mismatch is not None:
                raise mismatch
            raise RunNotFoundError(f"no validator advertising spec hash {spec_hash} served it: {'; '.join(unreachable)}")
    return AdoptedRun(spec_hash, path, run, epoch, uids)
