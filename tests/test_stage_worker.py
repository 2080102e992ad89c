"""Stage workers chained by hand reproduce the co-located trainer's steps; the cache is bounded."""
from __future__ import annotations

import gc

import pytest
import torch

from iota_subnet.config import load_config
from iota_subnet.miner import ActivationCache, StageWorker, UnknownMicrobatch
from iota_subnet.model import StagedModel, build_stages
from iota_subnet.train.optim import lr_at, make_optimizer, set_lr

OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 3, "grad_clip": 0.5}}


def _batches(cfg, steps):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (cfg.train.batch_size, cfg.data.seq_len + 1), generator=g) for _ in range(steps)]


def test_chained_workers_match_colocated_training(tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    data = _batches(cfg, 3)
    # reference: the co-located update rule (per-stage clipping, same schedule)
    stages = build_stages(cfg, seed=7)
    model = StagedModel(stages)
    opt = make_optimizer(model, cfg.train)
    mb = cfg.train.micro_batch
    for step, rows in enumerate(data):
        set_lr(opt, lr_at(step, 3, cfg.train))
        for m in range(0, rows.shape[0], mb):
            x, y = rows[m:m + mb, :-1], rows[m:m + mb, 1:]
            (model(x, y) / (cfg.train.batch_size // mb)).backward()
        for st in stages:
            torch.nn.utils.clip_grad_norm_(st.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    # three workers, activations and gradients passed by hand as the network would
    workers = [StageWorker(cfg, s, seed=7, total_steps=3) for s in range(3)]
    losses = []
    for step, rows in enumerate(data):
        for m in range(0, rows.shape[0], mb):
            mid = f"{step}-{m}"
            x, y = rows[m:m + mb, :-1], rows[m:m + mb, 1:]
            a0 = workers[0].forward(mid, x)["activations"]
            a1 = workers[1].forward(mid, a0)["activations"]
            out = workers[2].forward(mid, a1, y)
            losses.append(out["loss"])
            g1 = workers[1].backward(mid, out["grad"])
            assert workers[0].backward(mid, g1) is None
    assert all(w.inner_step == 3 for w in workers)
    for w, st in zip(workers, stages):
        ref = dict(st.named_parameters())
        for n, p in w.module.named_parameters():
            assert torch.allclose(p, ref[n], atol=1e-5, rtol=1e-4), (w.stage, n)
    assert len(losses) == 6 and all(l > 0 for l in losses)


def test_checkpoint_resume_and_wrong_stage(tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    w = StageWorker(cfg, 1, seed=1)
    w.step()
    path = w.save(tmp_path / "s1.safetensors")
    w2 = StageWorker(cfg, 1, seed=2)
    assert w2.load(path) and w2.inner_step == 1
    for (n, a), b in zip(w.module.state_dict().items(), w2.module.state_dict().values()):
        assert torch.equal(a, b), n
    from iota_subnet.train.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="another config"):
        StageWorker(cfg, 2).load(path)


def test_unknown_microbatch_and_bad_gradient_shape():
    cfg = load_config("configs/tiny.yaml", OVR)
    w = StageWorker(cfg, 1)
    with pytest.raises(UnknownMicrobatch):
        w.backward("nope", torch.zeros(2, 16, 16))
    w.forward("a", torch.randn(2, 16, 16))
    with pytest.raises(ValueError, match="gradient shape"):
        w.backward("a", torch.zeros(2, 16, 15))


def test_activation_cache_ttl_and_byte_cap():
    now = [0.0]
    c = ActivationCache(ttl_s=10, max_bytes=3 * 400, clock=lambda: now[0])
    for i in range(4):
        c.put(str(i), None, torch.zeros(100))      # 400 bytes each
    assert len(c) == 3 and "0" not in c and c.evictions["bytes"] == 1
    now[0] = 11.0
    assert c.pop("3") is None and c.evictions["ttl"] == 3 and c.bytes == 0


def test_backward_after_an_inner_step_recomputes_instead_of_failing():
    """A rerouted or second-validator micro-batch may see the stage step between its forward and
    backward; the miner recomputes the forward with the new weights."""
    cfg = load_config("configs/tiny.yaml", OVR)
    for stage in (0, 1):
        w = StageWorker(cfg, stage)
        x = torch.randint(0, 256, (2, 16)) if stage == 0 else torch.randn(2, 16, 16)
        w.forward("a", x)
        w.forward("b", x)
        w.backward("a", torch.randn(2, 16, 16))
        w.step()                                   # weights change while "b" waits for its backward
        g = w.backward("b", torch.randn(2, 16, 16))
        assert w.recomputes == 1
        assert (g is None) == (stage == 0)
        if g is not None:
            assert g.shape == (2, 16, 16) and torch.isfinite(g).all()
        assert any(p.grad is not None for p in w.module.parameters())


# ---------------------------------------------------------------------------------------------- item 4: memory bounds
def graph_bytes(entries, module) -> int:
    """Ground truth, independent of the cache's own measurement: the distinct storages the cached
    forwards' autograd graphs really keep (every ``_saved_*`` tensor of every node reachable from the
    outputs, plus inputs and outputs), the stage's parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    found: dict[int, int] = {}
    for e in entries:
        seen, stack = set(), [e.outputs.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for name in dir(node):
                if not name.startswith("_saved_"):
                    continue
                try:
                    v = getattr(node, name)
                except Exception:  # noqa: BLE001 - released or not a tensor
                    continue
                for t in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        if st.data_ptr() not in params:
                            found[st.data_ptr()] = st.nbytes()
            stack.extend(n for n, _ in node.next_functions)
        for t in (e.inputs, e.outputs):
            if t is not None:
                found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(found.values())


@pytest.mark.parametrize("stage", [0, 1])
def test_cache_bound_holds_when_backwards_never_come(stage):
    """Forwards arrive, backwards never do: the memory the cached graphs really hold (walked, not
    estimated) stays under the configured bound. The old bound counted inputs + outputs only, an
    entry's graph holds ~40x that here (313x for ``tiny`` at 4 x 256 tokens)."""
    cfg = load_config("configs/tiny.yaml", OVR)
    probe = StageWorker(cfg, stage)
    x0 = torch.randint(0, 256, (2, 16)) if stage == 0 else torch.randn(2, 16, 16)
    probe.forward("probe", x0)
    one = probe.cache.get("probe")
    assert one.nbytes == graph_bytes([one], probe.module)                       # measured = what it holds
    assert one.nbytes > 20 * ActivationCache.entry_bytes(one.inputs, one.outputs)
    bound = int(3.5 * one.nbytes)
    cache = ActivationCache(max_bytes=bound, max_entries=1000, ttl_s=1000)
    w = StageWorker(cfg, stage, cache=cache)
    assert w.cache is cache
    for i in range(25):
        x = torch.randint(0, 256, (2, 16)) if stage == 0 else torch.randn(2, 16, 16)
        w.forward(f"mb{i}", x)
        held = graph_bytes(list(cache._d.values()), w.module)
        # entries share the RoPE tables (held by the module anyway): each entry counts them, so the
        # cache's sum is at most a few KiB above what the graphs hold together
        assert held <= cache.bytes <= bound and cache.bytes - held <= 4096 * len(cache), (i, held, bound)
    assert len(cache) == 3 and cache.evictions["bytes"] == 22 and cache.peak_bytes <= bound


def _live_graph_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("stage", [0, 1])
def test_forwards_whose_backward_never_comes_free_their_graphs(stage):
    """Evicted and dropped forwards leave no autograd graph behind. (The CPU meter's saved-tensor
    hook once packed each saved tensor as itself: a tensor an op saves as its own output, e.g.
    attention's, then held its grad_fn through a Python reference, a cycle the garbage collector
    cannot see, and every forward whose backward never came leaked its graph: stage-0 miners of a
    3 x 3 localnet with audits on grew to 5 GB and were OOM-killed.)"""
    cfg = load_config("configs/tiny.yaml", OVR)
    before = _live_graph_tensors()
    cache = ActivationCache(max_bytes=1 << 30, max_entries=2, ttl_s=1000)
    w = StageWorker(cfg, stage, cache=cache)
    for i in range(6):
        w.forward(f"mb{i}", torch.randint(0, 256, (2, 16)) if stage == 0 else torch.randn(2, 16, 16))
    assert cache.evictions["entries"] == 4 and _live_graph_tensors() > before      # two graphs cached
    assert w.drop("mb4") and w.drop("mb5") and len(cache) == 0
    assert _live_graph_tensors() == before
    # a kept forward still backpropagates exactly as without the meter
    x = torch.randint(0, 256, (2, 16)) if stage == 0 else torch.randn(2, 16, 16)
    w.forward("kept", x)
    g = torch.randn(w.cache.get("kept").outputs.shape)
    gin = w.backward("kept", g)
    xr = x if stage == 0 else x.clone().requires_grad_(True)
    out = w.module(xr)
    grads = torch.autograd.grad(out, [p for p in w.module.parameters()] + ([] if stage == 0 else [xr]), g,
                                allow_unused=True)
    if stage:
        assert torch.allclose(gin, grads[-1], atol=1e-6)
    del out
    assert _live_graph_tensors() == before
    cache.close()


def test_cache_ttl_expires_without_new_forwards_and_caps_entries():
    cfg = load_config("configs/tiny.yaml", OVR)
    cache = ActivationCache(ttl_s=0.3, max_entries=2, max_bytes=1 << 30, sweep_s=0.05)
    w = StageWorker(cfg, 1, cache=cache)
    for i in range(3):
        w.forward(f"mb{i}", torch.randn(2, 16, 16))
    assert len(cache) == 2 and "mb0" not in cache and cache.evictions["entries"] == 1
    import time
    deadline = time.monotonic() + 5
    while len(cache) and time.monotonic() < deadline:      # no new put, no pop: the sweeper expires them
        time.sleep(0.05)
    assert len(cache) == 0 and cache.bytes == 0 and cache.evictions["ttl"] == 2
    # an entry larger than the whole bound is not kept (its backward gets UnknownMicrobatch)
    small = ActivationCache(max_bytes=1000)
    w2 = StageWorker(cfg, 1, cache=small)
    w2.forward("big", torch.randn(2, 16, 16))
    assert len(small) == 0 and small.evictions["too_large"] == 1
    with pytest.raises(UnknownMicrobatch):
        w2.backward("big", torch.zeros(2, 16, 16))
    cache.close()
    small.close()


def test_cache_limits_come_from_the_config():
    cfg = load_config("configs/tiny.yaml", {**OVR, "train": {**OVR["train"], "activation_cache_mib": 3,
                                                             "activation_cache_entries": 7,
                                                             "activation_cache_ttl_s": 9.0}})
    w = StageWorker(cfg, 1)
    assert (w.cache.max_bytes, w.cache.max_entries, w.cache.ttl_s) == (3 << 20, 7, 9.0)


def test_input_gradient_only_names_the_weights_it_recomputed_with():
    """A micro-batch served without training (an alternate's) whose backward comes after an inner
    step is recomputed with the new weights: the weights version it reports (what its receipt names,
    and a hop audit replays) is the new one, and it equals the gradient through the new weights."""
    cfg = load_config("configs/tiny.yaml", OVR)
    w = StageWorker(cfg, 1, seed=0)
    w.auto_step = False
    B, T, b = cfg.train.micro_batch, cfg.data.seq_len, w.spec.out_width
    x, g = torch.randn(B, T, b), torch.randn(B, T, b) * 1e-2
    w.forward("alt", x, accumulate=False)
    w.forward("own", x)
    w.backward("own", g)
    w.step()                                   # weights change while "alt" waits for its backward
    gin = w.backward("alt", g)
    assert (w.last_weights_step, w.last_weights_merges) == (1, 0)
    xr = x.clone().requires_grad_(True)
    w.module(xr).backward(g)
    assert torch.allclose(gin, xr.grad, atol=1e-6)


def test_the_rewarm_factor_ramps_only_a_state_younger_than_the_run():
    from iota_subnet.config import ConfigError, load_config
    from iota_subnet.train.optim import rewarm_factor
    # a state that took every step since step 0 (the schedule's warmup applies): no extra factor
    assert [rewarm_factor(k, k + 1, 10) for k in (0, 5, 149)] == [1.0, 1.0, 1.0]
    # a joiner's fresh moments at step 90: 1/10, 5/10, then the schedule's rate from 10 updates on
    assert [rewarm_factor(90, a, 10) for a in (1, 5, 10, 40)] == [0.1, 0.5, 1.0, 1.0]
    assert rewarm_factor(90, 1, 0) == 1.0                     # rewarm_steps 0: off
    with pytest.raises(ConfigError, match="rewarm_steps"):
        load_config("configs/tiny.yaml", {"train": {"rewarm_steps": -1}})


def test_the_predicted_adam_step_count_is_the_one_committed_after_the_update():
    """The worker sets the update's rate from the count AdamW will have after it; validators read the
    count committed after it (the largest over the parameters): a parameter without a gradient keeps
    its count, so the two agree when only some parameters have gradients."""
    from iota_subnet.train.optim import next_adam_step
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    assert next_adam_step(opt) == 0                              # no state, no gradient: nothing to step

    def update(params):
        opt.zero_grad(set_to_none=True)
        sum(p.sum() for p in params).backward()
        want = next_adam_step(opt)
        opt.step()
        got = max(int(st["step"]) for st in opt.state.values())
        assert want == got, (want, got)
    update(list(m.parameters()))                                 # 1 everywhere
    update(list(m[0].parameters()))                              # m[0] at 2, m[1] stays at 1
    update(list(m[1].parameters()))                              # m[1] at 2: the largest is still 2
