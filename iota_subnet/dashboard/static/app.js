// iota-subnet dashboard: polls api/snapshot and draws it. Read-only; no third-party requests.
// Plots use the vendored uPlot (MIT). All text goes in through textContent (never innerHTML).
(function () {
  "use strict";
  const PALETTE = ["#3b6fd1", "#e07b39", "#2e9d5b", "#9b59b6", "#cf3d3d", "#17a2b8", "#8c6d31", "#d62ea8",
                   "#5b8c00", "#6b7385"];
  const state = { plots: {}, keys: {}, snapshot: null };

  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v;
      else if (k === "class") e.className = v;
      else if (k === "style") e.style.cssText = v;
      else e.setAttribute(k, v);
    }
    for (const c of children || []) if (c != null) e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    return e;
  }
  function fmt(v, digits) {
    if (v === null || v === undefined || (typeof v === "number" && !isFinite(v))) return "–";
    if (typeof v !== "number") return String(v);
    if (digits !== undefined) return v.toFixed(digits);
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (Number.isInteger(v)) return String(v);
    return v.toPrecision(4);
  }
  function replace(id, node) { const c = document.getElementById(id); c.replaceChildren(node); }
  function table(headers, rows, numeric) {
    const num = new Set(numeric || []);
    return el("table", {}, [
      el("thead", {}, [el("tr", {}, headers.map((h, i) => el("th", { class: num.has(i) ? "num" : "", text: h })))]),
      el("tbody", {}, rows.map(r => el("tr", {}, r.map((c, i) =>
        c instanceof Node ? el("td", {}, [c]) : el("td", { class: num.has(i) ? "num" : (i === r.length - 1 && headers[i] === "why" ? "why" : ""), text: c })))))
    ]);
  }

  // ---------------------------------------------------------------- plots
  function align(lines) {
    const names = Object.keys(lines);
    const xs = Array.from(new Set(names.flatMap(n => lines[n].map(p => p[0])))).sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const ys = names.map(n => {
      const col = new Array(xs.length).fill(null);
      for (const [x, y] of lines[n]) col[index.get(x)] = y;
      return col;
    });
    return { names, data: [xs, ...ys] };
  }
  function plotWidth(card) {
    const body = card.querySelector(".plot-body");
    return Math.max(260, Math.floor(body.clientWidth || card.clientWidth - 28) - 2);
  }
  function drawPlot(key, spec, container) {
    const { names, data } = align(spec.lines || {});
    const pointsOnly = new Set(spec.points_only || []);
    const points = data.slice(1).reduce((n, col) => n + col.filter(v => v !== null).length, 0);
    const card = container;
    card.dataset.points = String(points);
    const sig = names.join("|");
    const body = card.querySelector(".plot-body");
    const width = plotWidth(card);
    if (data[0].length === 0) {
      if (state.plots[key]) { state.plots[key].destroy(); delete state.plots[key]; }
      body.replaceChildren(el("div", { class: "empty", text: "waiting for data…" }));
      state.keys[key] = null;
      return;
    }
    if (state.plots[key] && state.keys[key] === sig) {
      state.plots[key].setData(data);
      if (Math.abs(state.plots[key].width - width) > 4) state.plots[key].setSize({ width, height: 240 });
      return;
    }
    if (state.plots[key]) state.plots[key].destroy();
    body.replaceChildren();
    const opts = {
      width, height: 240,
      scales: { x: { time: false } },
      legend: { live: true },
      series: [{ label: spec.x }].concat(names.map((n, i) => ({
        label: n, stroke: PALETTE[i % PALETTE.length], width: pointsOnly.has(n) ? 0 : 1.5, spanGaps: true,
        points: { show: pointsOnly.has(n) || data[0].length < 40, size: pointsOnly.has(n) ? 7 : 4,
                  fill: PALETTE[i % PALETTE.length] },
        paths: pointsOnly.has(n) ? () => null : undefined,
      }))),
      axes: [{ label: spec.x, size: 40 }, { label: spec.y, size: 60 }],
    };
    state.plots[key] = new uPlot(opts, data, body);
    state.keys[key] = sig;
  }
  function renderPlots(series) {
    const host = document.getElementById("plots");
    const entries = Object.entries(series || {});
    for (const [key, spec] of entries) {      // every card first: the grid's columns are final before sizing
      if (!document.getElementById("plot-" + key)) {
        const card = el("section", { class: "card plot-card", id: "plot-" + key, "data-plot": key }, [
          el("h2", { text: spec.title || key }), el("div", { class: "plot-body" })]);
        host.appendChild(card);
        // a plot follows its card's width (grid reflow, window resize, scrollbar)
        new ResizeObserver(() => {
          const u = state.plots[key];
          const w = plotWidth(card);
          if (u && Math.abs(u.width - w) > 4) u.setSize({ width: w, height: 240 });
        }).observe(card);
      }
    }
    for (const [key, spec] of entries) drawPlot(key, spec, document.getElementById("plot-" + key));
  }

  // ---------------------------------------------------------------- sections
  function chip(label, value) { return el("div", { class: "chip" }, [el("span", { text: label }), el("b", { text: value })]); }
  function renderTotals(s) {
    const t = s.totals || {};
    const id = s.identity || {};
    const chips = [];
    if (s.role === "validator") {
      const steps = t.steps_done ? Object.values(t.steps_done) : [];
      chips.push(chip("block", fmt((s.chain || {}).block)), chip("tokens", fmt(t.tokens)),
                 chip("tokens/s", fmt(t.tokens_per_s, 0)), chip("train loss", fmt(t.loss, 3)),
                 chip("val loss", fmt(t.val_loss, 3)),
                 chip("lane steps", steps.length ? Math.min(...steps) + " / " + fmt(t.total_steps) : "–"),
                 chip("live miners", fmt(t.live_miners)), chip("reroutes", fmt(t.reroutes)),
                 chip("failed hops", fmt(t.failures)), chip("state", t.done ? "done" : "training"));
      document.getElementById("title").textContent =
        `iota-subnet validator · uid ${fmt(id.uid)} · run ${id.run_id || "–"} · netuid ${fmt(id.netuid)}`;
    } else {
      chips.push(chip("stage", fmt(id.stage)), chip("inner step", fmt(t.inner_step)), chip("tokens", fmt(t.tokens)),
                 chip("forwards", fmt(t.forwards)), chip("backwards", fmt(t.backwards)),
                 chip("uptime s", fmt(t.uptime_s, 0)));
      document.getElementById("title").textContent = `iota-subnet miner · uid ${fmt(id.uid)} · stage ${fmt(id.stage)}`;
    }
    replace("totals", el("div", { class: "chips" }, chips));
  }
  function renderPipeline(p) {
    const card = document.getElementById("pipeline-card");
    if (!p) { card.hidden = true; return; }
    card.hidden = false;
    const cells = p.cells || [];
    const stages = Math.max(p.stages || 0, ...cells.map(c => (c.stage || 0) + 1));
    const maxW = Math.max(1e-9, ...cells.map(c => c.weight || 0));
    const cols = [];
    for (let s = 0; s < stages; s++) {
      const mine = cells.filter(c => c.stage === s).sort((a, b) => (a.lane ?? 99) - (b.lane ?? 99) || a.uid - b.uid);
      cols.push(el("div", { class: "col" }, [el("h3", { text: `stage ${s}` })].concat(mine.map(c =>
        el("div", { class: "cell " + c.state, "data-uid": String(c.uid) }, [
          el("div", {}, [el("span", { class: "uid", text: `uid ${c.uid}` }), " ",
                         el("span", { class: "badge " + c.state, text: c.state }), " ",
                         el("span", { text: c.lane !== null && c.lane !== undefined ? `lane ${c.lane}` : "spare" })]),
          el("div", { text: `step ${fmt(c.inner_step)} · ${fmt(c.throughput, 0)} tok/s · ok ${fmt(c.successes)} / fail ${fmt(c.failures)}` }),
          el("div", { text: `work ${fmt(c.work)} · weight ${fmt(c.weight, 4)}` + (c.health_error ? ` · ${c.health_error}` : "") }),
          (c.relays && c.relays.length) ? el("div", { class: "relay", text: `behind a NAT, via relay ${c.relays.join(", ")}` }) : el("span", {}),
          c.path ? el("div", { class: "relay", text: `path: ${c.path.kind}${c.path.via ? " via " + c.path.via : ""}` }) : el("span", {}),
          el("div", { class: "bar" }, [el("div", { style: `width:${Math.round(100 * (c.weight || 0) / maxW)}%` })]),
        ])))));
    }
    const grid = el("div", { class: "grid", style: `grid-template-columns: repeat(${Math.max(1, stages)}, minmax(160px, 1fr))` }, cols);
    replace("pipeline", cells.length ? grid : el("p", { text: "no miners of this run seen yet" }));
  }
  function renderScores(sc) {
    const card = document.getElementById("verification-card");
    if (!sc) { card.hidden = true; return; }
    card.hidden = false;
    const rows = (sc.miners || []).map(m => {
      const a = m.audits || {};
      const cl = m.clasp;
      const flagged = a.flagged || (cl && cl.flagged);
      return [String(m.uid), String(m.stage), fmt(m.work, 1),
              `${a.passed || 0}/${(a.failed || 0) + (a.refused || 0) + (a.timed_out || 0)}/${a.excused || 0}`,
              cl ? `${cl.excess >= 0 ? "+" : ""}${fmt(cl.excess, 3)} (${fmt(cl.z, 1)})${cl.flagged ? "!" : ""}` : "-",
              m.quality === null || m.quality === undefined ? "-" : fmt(m.quality, 2), fmt(m.weight || 0, 4),
              el("span", { class: "badge " + (flagged ? "bad" : "ok"), text: flagged ? "flagged" : "ok" }),
              (m.why || []).join("; ")];
    });
    replace("verification", rows.length ? table(["uid", "stage", "work total", "checks ok/fail/skip", "CLASP excess (z)",
                                                 "quality", "weight", "flag", "why"], rows, [0, 1, 2, 5, 6])
                                         : el("p", { text: "no scores yet (they come with the first weights round)" }));
  }
  function renderMerges(m) {
    const card = document.getElementById("merges-card");
    const reps = (m && m.replicas) || [];
    if (!m) { card.hidden = true; return; }
    card.hidden = false;
    const any = reps.some(r => r.merges !== null && r.merges !== undefined);
    replace("merges", any ? table(["uid", "stage", "merges applied", "merged epoch", "abandoned", "last merge s", "in sync"],
      reps.map(r => [String(r.uid), String(r.stage), fmt(r.merges), fmt(r.merged_epoch), fmt(r.merges_abandoned),
                     fmt(r.merge_last_wall_s, 2), r.in_sync === null || r.in_sync === undefined ? "–" : (r.in_sync ? "yes" : "no")]),
      [0, 1, 2, 3, 4, 5]) : el("p", { text: "merging is off for this run (or no replica has reported a merge yet)" }));
  }
  function renderRelays(r) {
    const card = document.getElementById("relays-card");
    const rows = Object.entries((r && r.relayed) || {});
    card.hidden = !rows.length;
    if (!rows.length) return;
    const now = (r && r.attached) || {};
    replace("relays", table(["miner", "attached now", "requests", "bytes"],
      rows.map(([hk, v]) => [hk.slice(0, 10), hk in now ? "yes" : "no", fmt(v.requests), fmt(v.bytes)]), [2, 3]));
  }
  function renderChain(c) {
    const card = document.getElementById("chain-card");
    if (!c) { card.hidden = true; return; }
    card.hidden = false;
    const kv = el("dl", { class: "kv" }, [
      ["network", c.network], ["netuid", c.netuid], ["block", c.block], ["tempo (blocks)", c.tempo],
      ["weights rate limit", c.weights_rate_limit], ["chain latency ms", c.latency_ms],
      ["weights set", c.weights_set], ["at blocks", (c.weights_set_blocks || []).join(", ") || "–"],
      ["next weights ≈ block", c.next_weights_block], ["chain error", c.error]]
      .filter(([, v]) => v !== undefined && v !== null && v !== "")
      .flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: typeof v === "number" ? fmt(v) : String(v) })]));
    const mg = (c.metagraph || []).map(r => [String(r.uid), r.hotkey, fmt(r.stake, 2), r.validator_permit ? "yes" : "",
                                             fmt(r.incentive, 4), fmt(r.dividends, 4), fmt(r.emission, 4),
                                             fmt((c.last_weights || {})[String(r.uid)], 4)]);
    replace("chain", el("div", {}, [kv, mg.length ? table(["uid", "hotkey", "stake", "permit", "incentive", "dividends",
                                                         "emission", "our weight"], mg, [0, 2, 4, 5, 6, 7]) : null]));
  }
  function renderOutcomes(o) {
    const card = document.getElementById("outcomes-card");
    if (!o) { card.hidden = true; return; }
    card.hidden = false;
    replace("outcomes", table(["outcome", "requests"], Object.entries(o).map(([k, v]) => [k, fmt(v)]), [1]));
  }

  function render(s) {
    renderTotals(s);
    renderPlots(s.series);
    renderPipeline(s.pipeline);
    renderScores(s.scores);
    renderMerges(s.merges);
    renderRelays(s.relays);
    renderChain(s.chain);
    renderOutcomes(s.role === "miner" ? s.outcomes : null);
  }

  async function tick() {
    const conn = document.getElementById("conn");
    try {
      const r = await fetch("api/snapshot", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const s = await r.json();
      state.snapshot = s;
      render(s);
      conn.textContent = "live · " + new Date(s.generated_at * 1000).toLocaleTimeString();
      conn.className = "conn live";
      window.iotaDashboard.updates += 1;
    } catch (e) {
      conn.textContent = "disconnected (" + e.message + "); retrying";
      conn.className = "conn down";
    }
  }

  // For people and for tests: the plots and how many points each one holds.
  window.iotaDashboard = {
    updates: 0,
    plots: state.plots,
    snapshot: () => state.snapshot,
    pointCounts: () => Object.fromEntries(Array.from(document.querySelectorAll(".plot-card"))
      .map(c => [c.dataset.plot, Number(c.dataset.points || 0)])),
  };
  tick();
  setInterval(tick, 2000);
})();
