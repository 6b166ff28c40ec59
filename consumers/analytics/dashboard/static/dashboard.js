// The clawstream dashboard page: polls /api/state and redraws every chart with plotly.js (Plotly.react keeps the
// zoom and only touches what changed). window.clawstreamDashboard exposes the last state and the update count
// (the browser test reads them, and each chart's data, from here and the chart elements).
"use strict";

(function () {
  const dash = { updates: 0, failures: 0, state: null, lastError: null };
  window.clawstreamDashboard = dash;
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };
  const MARGIN = { l: 48, r: 16, t: 8, b: 36 };
  const STATUS_COLORS = { running: "#2e90fa", ok: "#12b76a", failed: "#f79009", timed_out: "#9e77ed",
                          infra: "#d92d20" };

  function layout(extra) {
    return Object.assign({ margin: MARGIN, showlegend: true, legend: { orientation: "h", y: -0.2 },
                           paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
                           font: { size: 11 } }, extra || {});
  }

  function waiting(traces, extra) {
    // An empty chart says so instead of showing bare axes.
    const empty = traces.every((t) => !t.x || t.x.length === 0);
    const base = layout(extra);
    if (empty) {
      base.annotations = [{ text: "waiting for data", showarrow: false, xref: "paper", yref: "paper", x: 0.5,
                            y: 0.5, font: { color: "#6a7383" } }];
    }
    return base;
  }

  function draw(id, traces, extra) {
    Plotly.react(document.getElementById(id), traces, waiting(traces, extra), CONFIG);
  }

  function pct(v) { return v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%"; }
  function num(v, d) { return v === null || v === undefined ? "-" : Number(v).toFixed(d); }

  function fillTable(id, head, rows) {
    const table = document.getElementById(id);
    table.tHead.innerHTML = "<tr>" + head.map((h) => "<th>" + h + "</th>").join("") + "</tr>";
    const body = table.tBodies[0];
    body.textContent = "";
    for (const row of rows) {
      const tr = document.createElement("tr");
      for (const cell of row) {
        const td = document.createElement("td");
        td.textContent = cell;  // text, never HTML: harness names come from the topics
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }

  function render(s) {
    const reward = Object.entries(s.reward).map(([name, d]) => ({
      name: name, x: d.steps, y: d.mean, customdata: d.n, type: "scatter", mode: "lines+markers",
      hovertemplate: "step %{x}: %{y:.3f} (%{customdata} rollouts)<extra>" + name + "</extra>",
    }));
    draw("chart-reward", reward, { xaxis: { title: { text: "step" }, dtick: 1 },
                                   yaxis: { title: { text: "mean reward" } } });

    const names = Object.keys(s.status);
    draw("chart-status", [{ type: "bar", x: names, y: names.map((n) => s.status[n]),
                            marker: { color: names.map((n) => STATUS_COLORS[n]) }, name: "rollouts" }],
         { showlegend: false });

    const rows = s.health.filter((r) => r.harness !== "(all)");
    const labels = rows.map((r) => r.harness + " / " + r.template);
    const bar = (name, key) => ({ type: "bar", name: name, x: labels,
                                  y: rows.map((r) => (r[key] === null ? null : 100 * r[key])) });
    draw("chart-health", [bar("extend exactly %", "extends_share"), bar("masked tokens %", "masked_token_fraction"),
                          bar("cache hit %", "prefix_cache_hit_rate")],
         { barmode: "group", yaxis: { title: { text: "%" }, range: [0, 100] } });
    fillTable("health-table",
      ["harness", "template", "rollouts", "main calls", "extend exactly", "re-renders / r.", "forks / r.",
       "answer forks", "masked", "orphans", "stale attempt", "cache hit", "tampered",
       "grader error"],
      s.health.map((r) => [r.harness, r.template, r.rollouts, r.main_calls,
                           pct(r.extends_share) + " (" + r.extends + "/" + r.follow_ups + ")",
                           num(r.full_renders_per_rollout, 2), num(r.forks_per_rollout, 2), r.answer_forks,
                           pct(r.masked_token_fraction), r.retry_orphans, r.stale_attempt_calls,
                           pct(r.prefix_cache_hit_rate), r.tampered_rollouts + " (" + r.tampered_calls + ")",
                           r.grader_error_rollouts]));

    const t = s.tree;
    draw("chart-tree", [
      { type: "bar", name: "leaves / rollout", x: t.harnesses, y: t.leaves_per_rollout },
      { type: "bar", name: "prefix reuse (Σpath / unique)", x: t.harnesses, y: t.prefix_reuse },
    ], { barmode: "group" });
    draw("chart-tokens", [
      { type: "bar", name: "tokens trained", x: t.harnesses, y: t.trained_tokens },
      { type: "bar", name: "Σ path tokens", x: t.harnesses, y: t.path_tokens },
      { type: "bar", name: "unique tokens", x: t.harnesses, y: t.unique_tokens },
    ], { barmode: "group" });

    const tp = s.throughput;
    draw("chart-throughput", [
      { type: "scatter", mode: "lines", name: "calls/s", x: tp.t, y: tp.calls_per_s },
      { type: "scatter", mode: "lines", name: "generated tokens/s", x: tp.t, y: tp.generated_tokens_per_s,
        yaxis: "y2" },
      { type: "scatter", mode: "lines", name: "prompt tokens/s", x: tp.t, y: tp.prompt_tokens_per_s,
        yaxis: "y2", line: { dash: "dot" } },
    ], { yaxis: { title: { text: "calls/s" } },
         yaxis2: { title: { text: "tokens/s" }, overlaying: "y", side: "right" }, margin: { l: 48, r: 56, t: 8, b: 36 } });

    draw("chart-lag", [
      { type: "scatter", mode: "lines+markers", name: "mean", x: s.lag.t, y: s.lag.mean },
      { type: "scatter", mode: "lines+markers", name: "max", x: s.lag.t, y: s.lag.max },
    ], { yaxis: { title: { text: "versions" }, rangemode: "tozero" } });

    const w = s.weights;
    const weights = [{ type: "scatter", mode: "lines+markers", line: { shape: "hv" }, name: "published",
                       x: w.published.t, y: w.published.version }];
    for (const [engine, d] of Object.entries(w.applied)) {
      weights.push({ type: "scatter", mode: "markers", name: "applied: " + engine, x: d.t, y: d.version,
                     customdata: d.latency_s, marker: { size: 9, symbol: "diamond" },
                     hovertemplate: "v%{y} (%{customdata:.3f} s after publishing)<extra>" + engine + "</extra>" });
    }
    draw("chart-weights", weights, { yaxis: { title: { text: "version" }, dtick: 1, rangemode: "tozero" } });

    fillTable("engine-table", ["engine", "serving", "prefix-cache hit", "tokens/s", "versions applied"],
      Array.from(new Set(Object.keys(s.engines).concat(Object.keys(w.applied)))).sort().map((e) => {
        const st = s.engines[e] || {};
        const applied = w.applied[e] ? w.applied[e].version.length : 0;
        return [e, st.policy_version === undefined ? "-" : "v" + st.policy_version,
                pct(st.prefix_cache_hit_rate), num(st.tokens_per_s, 1), applied];
      }));

    const total = Object.values(s.records).reduce((a, b) => a + b, 0);
    document.getElementById("prefix").textContent = "topics: " + (s.feed.prefix || "(no prefix)");
    document.getElementById("records").textContent = total + " records read";
    document.getElementById("updated").textContent = "updated " + new Date(s.updated_ms).toLocaleTimeString();
    const problems = [];
    if (s.errors.count) problems.push(s.errors.count + " undecodable record(s): " + s.errors.last);
    if (s.feed.error) problems.push("feed: " + s.feed.error);
    const problem = document.getElementById("problem");
    problem.hidden = problems.length === 0;
    problem.textContent = problems.join("; ");
  }

  async function tick() {
    let delay = 2000;
    try {
      const response = await fetch("/api/state", { cache: "no-store" });
      if (!response.ok) throw new Error("/api/state answered " + response.status);
      const s = await response.json();
      delay = s.refresh_ms || delay;
      render(s);
      dash.state = s;
      dash.updates += 1;
      dash.lastError = null;
    } catch (err) {
      // The server may be restarting: say so on the page and try again (no console noise).
      dash.failures += 1;
      dash.lastError = String(err);
      const problem = document.getElementById("problem");
      problem.hidden = false;
      problem.textContent = "cannot reach the dashboard server: " + err;
    }
    setTimeout(tick, delay);
  }

  async function lagTick() {
    // Consumer lag asks the broker (not the topics), so it has its own, slower poll: /api/lag every 5 s.
    try {
      const response = await fetch("/api/lag", { cache: "no-store" });
      const r = await response.json();
      const rows = [];
      for (const g of r.groups) {
        rows.push([g.group, "total (" + g.state + ")", "", g.total]);
        for (const p of g.partitions) {
          if (p.lag) rows.push([g.group, p.topic, p.partition, p.lag]);
        }
      }
      fillTable("lag-table", ["group", "topic", "partition", "lag"], rows);
      dash.lag = r;
      document.getElementById("lag-note").textContent = r.error ? "lag: " + r.error
        : "each group's total, then its partitions still behind; docs/dashboard.md";
    } catch (err) {
      dash.lag = { error: String(err) };
    }
    setTimeout(lagTick, 5000);
  }

  tick();
  lagTick();
})();
