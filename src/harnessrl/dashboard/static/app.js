// harnessrl dashboard: one page, four views chosen by the URL hash, drawn from the read-only JSON API.
//   #/                     the run: summary, plots per step, the steps table
//   #/suspects?checks=KEY  rollouts whose reward rose while their checks did not (reward hacking?)
//   #/rollouts?step=N&...  groups of a step and a page of rollouts, with filters
//   #/rollout/ID           one rollout: attempts, calls with their conversation and tool calls, rows
// Everything recorded is put into the page with textContent (never as HTML): model output is untrusted.
"use strict";

const PAGE = 50;
const app = document.getElementById("app");
let liveToken = null;
let rendering = false;

// ---- small helpers --------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return e;
}
const svgNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const e = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) if (c) e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
  return e;
}
function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") {
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) < 10 ** -digits ? v.toExponential(2) : v.toFixed(digits);  // 1.2e-7, not -0.000
  }
  return String(v);
}
let runOnce = null;  // the first /api/run answer, shared by the title and the first view
async function api(path) {
  if (path === "/api/run" && runOnce) { const p = runOnce; runOnce = null; return p; }
  const r = await fetch(path, { headers: { Accept: "application/json" } });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
  return body;
}
function parseHash() {
  const h = location.hash.replace(/^#/, "") || "/";
  const [path, query] = h.split("?");
  return { path, params: new URLSearchParams(query || "") };
}
function link(text, href, attrs) { return el("a", { href, ...(attrs || {}) }, text); }
function stateCell(state) { return el("span", { class: `state-${state}` }, state); }

// ---- charts (SVG, no library) ---------------------------------------------------------------------
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];

function lineChart(title, series, id) {
  // series: [{name, points: [[x, y], ...]}]
  const box = el("div", { class: "card chart", id });
  box.appendChild(el("h3", {}, title));
  const pts = series.flatMap((s) => s.points).filter((p) => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
  if (!pts.length) { box.appendChild(el("div", { class: "empty" }, "no data yet")); return box; }
  const W = 320, H = 150, L = 44, R = 8, T = 8, B = 22;
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title });
  g.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#cbd5e1" }));
  g.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#cbd5e1" }));
  for (const [v, y] of [[y1, T + 8], [y0, H - B]]) g.appendChild(svg("text", { x: L - 4, y, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, fmt(v, 3)));
  for (const [v, x, a] of [[x0, L, "start"], [x1, W - R, "end"]]) g.appendChild(svg("text", { x, y: H - 6, "text-anchor": a, "font-size": 10, fill: "#6b7280" }, `step ${fmt(v, 0)}`));
  series.forEach((s, i) => {
    const ps = s.points.filter((p) => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
    const color = s.color || COLORS[i % COLORS.length];
    if (ps.length > 1) g.appendChild(svg("polyline", { points: ps.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none", stroke: color, "stroke-width": 1.8 }));
    for (const p of ps) g.appendChild(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.6, fill: color }, svg("title", {}, `${s.name} step ${p[0]}: ${fmt(p[1], 4)}`)));
  });
  box.appendChild(g);
  if (series.length > 1) box.appendChild(el("div", { class: "legend" }, series.map((s, i) => el("span", {}, el("i", { style: `background:${s.color || COLORS[i % COLORS.length]}` }), s.name))));
  return box;
}

function stackedBars(title, steps, parts, id) {
  // parts: [{name, values: {step: seconds}}]
  const box = el("div", { class: "card chart", id });
  box.appendChild(el("h3", {}, title));
  const totals = steps.map((s) => parts.reduce((a, p) => a + (p.values[s] || 0), 0));
  if (!steps.length || Math.max(...totals) <= 0) { box.appendChild(el("div", { class: "empty" }, "no data yet")); return box; }
  const W = 320, H = 150, L = 44, R = 8, T = 8, B = 22, top = Math.max(...totals);
  const bw = (W - L - R) / steps.length;
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title });
  g.appendChild(svg("text", { x: L - 4, y: T + 8, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, `${fmt(top, 1)}s`));
  g.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#cbd5e1" }));
  steps.forEach((s, i) => {
    let y = H - B;
    parts.forEach((p, j) => {
      const v = p.values[s] || 0, h = (v / top) * (H - T - B);
      if (h > 0) g.appendChild(svg("rect", { x: L + i * bw + 1, y: y - h, width: Math.max(bw - 2, 1), height: h, fill: COLORS[j % COLORS.length] }, svg("title", {}, `step ${s} ${p.name}: ${fmt(v, 2)}s`)));
      y -= h;
    });
  });
  g.appendChild(svg("text", { x: L, y: H - 6, "font-size": 10, fill: "#6b7280" }, `step ${steps[0]}`));
  g.appendChild(svg("text", { x: W - R, y: H - 6, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, `step ${steps[steps.length - 1]}`));
  box.appendChild(g);
  box.appendChild(el("div", { class: "legend" }, parts.map((p, j) => el("span", {}, el("i", { style: `background:${COLORS[j % COLORS.length]}` }), p.name))));
  return box;
}

// ---- the run view ---------------------------------------------------------------------------------
async function runView() {
  const [run, steps] = await Promise.all([api("/api/run"), api("/api/steps")]);
  const m = steps.metrics;
  const series = (key) => m.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
  const ratio = (a, b) => m.filter((r) => typeof r[a] === "number" && r[b]).map((r) => [r.step, r[a] / r[b]]);
  const s = run.summary || {};
  const temps = [...new Set(steps.heldout.map((h) => h.temperature))];
  const heldout = temps.map((t) => ({ name: `temperature ${t.replace(/^t/, "")}`,
    points: steps.heldout.filter((h) => h.temperature === t).map((h) => [h.step, h.mean]) }));
  const counts = Object.entries(run.counts).map(([phase, c]) => `${phase}: ` + Object.entries(c).map(([k, v]) => `${v} ${k}`).join(", "));
  const out = el("div", { id: "view-run" },
    el("h1", {}, run.name ? `run ${run.name}` : "run", el("span", { class: "muted" }, run.run_id ? `  ${run.run_id}` : "")),
    el("div", { class: "card" }, el("dl", { class: "kv" },
      el("dt", {}, "directory"), el("dd", {}, run.run_dir),
      el("dt", {}, "model"), el("dd", {}, run.model || "–"),
      el("dt", {}, "steps"), el("dd", {}, `${run.steps_recorded} recorded` + (run.steps_planned ? ` of ${run.steps_planned}` : "")),
      el("dt", {}, "rollouts"), el("dd", { id: "rollout-counts" }, `${run.rollouts} (${counts.join("; ") || "none"})`),
      el("dt", {}, "held-out reward"), el("dd", {}, s.heldout_reward_before === undefined ? "–" : `${fmt(s.heldout_reward_before)} before → ${fmt(s.heldout_reward_after)} after`),
      el("dt", {}, "adapter"), el("dd", {}, `merge ${run.settings.merge_calls ? "on" : "off"}, ${run.settings.estimator}, ${run.settings.loss_mode}, zero-variance groups: ${run.settings.zero_variance}`))),
    el("h2", {}, "per step"),
    el("div", { class: "grid", id: "charts" },
      lineChart("reward (training rollouts)", [{ name: "reward", points: series("reward") }], "chart-reward"),
      lineChart("held-out reward", heldout.length ? heldout : [{ name: "held-out", points: [] }], "chart-heldout"),
      lineChart("loss", [{ name: "loss", points: series("loss") }], "chart-loss"),
      lineChart("KL to reference", [{ name: "kl", points: series("kl") }], "chart-kl"),
      lineChart("entropy", [{ name: "entropy", points: series("entropy") }], "chart-entropy"),
      lineChart("length (tokens)", [{ name: "tokens / row", points: ratio("tokens", "rows") }, { name: "trainable / rollout", points: ratio("trainable_tokens", "rollouts") }], "chart-length"),
      lineChart("merge rate", [{ name: "merge rate", points: series("merge_rate") }], "chart-merge"),
      stackedBars("time per step", m.map((r) => r.step), [
        { name: "rollouts", values: Object.fromEntries(m.map((r) => [r.step, r.time_rollout_s || 0])) },
        { name: "update", values: Object.fromEntries(m.map((r) => [r.step, r.time_update_s || 0])) },
        { name: "weight sync", values: Object.fromEntries(m.map((r) => [r.step, r.time_weight_sync_s || 0])) },
        { name: "evaluation", values: Object.fromEntries(m.map((r) => [r.step, r.time_eval_s || 0])) },
      ], "chart-time")),
    el("h2", {}, "steps"),
    stepsTable(steps));
  return out;
}

function stepsTable(steps) {
  const byStep = Object.fromEntries(steps.metrics.map((r) => [r.step, r]));
  const heldout = {};  // the evaluation after a step (its first temperature), from its rollouts
  for (const h of steps.heldout) if (!(h.step in heldout)) heldout[h.step] = h.mean;
  const cols = ["step", "reward", "held-out", "loss", "kl", "entropy", "rollouts", "failed", "rows", "merge rate", "breaks", "time s"];
  return el("table", { id: "steps-table" },
    el("thead", {}, el("tr", {}, cols.map((c) => el("th", { class: c === "step" || c === "breaks" ? "" : "num" }, c)))),
    el("tbody", {}, steps.steps.map((s) => {
      const r = byStep[s] || {}, rec = steps.recorded[s] || {};
      const breaks = Object.entries(r.breaks || {}).map(([k, v]) => el("span", { class: "badge break" }, `${k} ${v}`));
      const time = ["time_rollout_s", "time_update_s", "time_weight_sync_s", "time_eval_s"].reduce((a, k) => a + (r[k] || 0), 0);
      return el("tr", {},
        el("td", {}, link(`step ${s}`, `#/rollouts?step=${s}`)),
        el("td", { class: "num" }, fmt(r.reward)), el("td", { class: "num" }, fmt(r.heldout_reward ?? heldout[s])),
        el("td", { class: "num" }, fmt(r.loss, 4)), el("td", { class: "num" }, fmt(r.kl, 4)), el("td", { class: "num" }, fmt(r.entropy, 3)),
        el("td", { class: "num" }, fmt(rec.rollouts ?? r.rollouts)), el("td", { class: "num" }, fmt(rec.failed ?? r.rollouts_failed)),
        el("td", { class: "num" }, fmt(r.rows)), el("td", { class: "num" }, fmt(r.merge_rate)),
        el("td", {}, breaks.length ? breaks : "–"), el("td", { class: "num" }, time ? fmt(time, 1) : "–"));
    })));
}

// ---- the rollouts view ----------------------------------------------------------------------------
const FILTERS = ["phase", "step", "group", "task", "state", "zero_variance", "reward_min", "reward_max"];

function filterForm(params) {
  const input = (name, attrs) => el("input", { name, value: params.get(name) || "", ...attrs });
  const select = (name, options) => {
    const s = el("select", { name }, options.map(([v, t]) => el("option", { value: v }, t)));
    s.value = params.get(name) || options[0][0];
    return s;
  };
  const form = el("form", { class: "filters", id: "filters", onsubmit: (e) => { e.preventDefault(); apply(); } },
    el("label", {}, "phase", select("phase", [["train", "training"], ["eval", "held-out"], ["all", "all"]])),
    el("label", {}, "step", input("step", { type: "number", min: 0 })),
    el("label", {}, "state", select("state", [["", "any"], ["failed", "failed or cancelled"], ["succeeded", "succeeded"], ["running", "running"], ["queued", "queued"]])),
    el("label", {}, "group", select("zero_variance", [["", "any group"], ["1", "zero-variance groups"]])),
    el("label", {}, "reward ≥", input("reward_min", { type: "number", step: "any" })),
    el("label", {}, "reward ≤", input("reward_max", { type: "number", step: "any" })),
    el("label", {}, "task", input("task", { placeholder: "task id contains" })),
    el("button", { type: "submit", id: "apply" }, "apply"));
  function apply() {
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form).entries()) if (v !== "" && !(k === "phase" && v === "train")) q.set(k, v);
    if (params.get("group")) q.set("group", params.get("group"));
    location.hash = `#/rollouts?${q}`;
  }
  form.addEventListener("change", apply);
  return form;
}

async function rolloutsView(params) {
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  const q = new URLSearchParams();
  for (const k of FILTERS) if (params.get(k)) q.set(k, params.get(k));
  q.set("offset", offset); q.set("limit", PAGE);
  const step = params.get("step");
  const phase = params.get("phase") || "train";
  const [page, groups] = await Promise.all([
    api(`/api/rollouts?${q}`),
    step !== null && step !== "" ? api(`/api/groups?step=${encodeURIComponent(step)}&phase=${phase}`) : Promise.resolve(null),
  ]);
  const out = el("div", { id: "view-rollouts" },
    el("h1", {}, step ? `step ${step}` : phase === "eval" ? "held-out rollouts" : "rollouts"),
    filterForm(params));
  if (groups) {
    out.appendChild(el("h2", {}, `groups (${groups.groups.length})`));
    out.appendChild(el("table", { id: "groups-table" },
      el("thead", {}, el("tr", {}, ["group", "task", "rollouts", "failed", "rewards", "mean", "std", ""].map((c) => el("th", {}, c)))),
      el("tbody", {}, groups.groups.map((g) => el("tr", {},
        el("td", {}, link(g.group_id, `#/rollouts?step=${step}&phase=${phase}&group=${encodeURIComponent(g.group_id)}`)),
        el("td", {}, g.task_id), el("td", { class: "num" }, g.rollouts), el("td", { class: "num" }, g.failed),
        el("td", {}, g.rewards.map((r) => fmt(r, 2)).join(" ")), el("td", { class: "num" }, fmt(g.reward_mean)),
        el("td", { class: "num" }, fmt(g.reward_std)), el("td", {}, g.zero_variance ? el("span", { class: "badge zv" }, "zero variance") : ""))))));
  }
  out.appendChild(el("h2", {}, params.get("group") ? `rollouts of group ${params.get("group")}` : "rollouts"));
  out.appendChild(pager(page, params));
  const cols = ["rollout", "step", "task", "group", "state", "reward", "adv", "att", "calls", "rows", "merge breaks"];
  out.appendChild(el("table", { id: "rollouts-table" },
    el("thead", {}, el("tr", {}, cols.map((c) => el("th", {}, c)))),
    el("tbody", {}, page.items.length ? page.items.map((r) => el("tr", { "data-rollout": r.rollout_id },
      el("td", {}, link(r.rollout_id, `#/rollout/${encodeURIComponent(r.rollout_id)}`)),
      el("td", { class: "num" }, r.eval_label || (r.step ?? (r.group_index !== null ? `g${r.group_index}` : "–"))),
      el("td", {}, r.task_id), el("td", {}, r.group_id || "–", r.zero_variance_group ? el("span", { class: "badge zv", title: "every graded rollout of this group got the same reward" }, "zv") : ""),
      el("td", {}, stateCell(r.state)), el("td", { class: "num" }, fmt(r.reward)), el("td", { class: "num" }, fmt(r.advantage)),
      el("td", { class: "num" }, r.attempts), el("td", { class: "num" }, r.calls), el("td", { class: "num" }, r.rows),
      el("td", {}, Object.entries(r.breaks).map(([k, v]) => el("span", { class: "badge break" }, `${k} ${v}`))))) :
      el("tr", {}, el("td", { colspan: cols.length, class: "muted" }, "no rollout matches these filters")))));
  out.appendChild(pager(page, params));
  return out;
}

async function suspectsView(params) {
  const q = new URLSearchParams();
  for (const k of ["checks", "phase"]) if (params.get(k)) q.set(k, params.get(k));
  const s = await api(`/api/suspects?${q}`);
  const cols = ["rollout", "step", "task", "reward", `checks (${s.checks})`, "baseline", "its reward", "its checks", "rise", "hacking"];
  const rid = (id) => link(id, `#/rollout/${encodeURIComponent(id)}`);
  return el("div", { id: "view-suspects" },
    el("h1", {}, "reward rose, checks did not"),
    el("p", { class: "muted" }, `A rollout is listed when another rollout of its task got a lower reward while passing at least as many checks ` +
      `(details.${s.checks}). ${s.graded} graded rollouts, ${s.without_checks} without that detail, ${s.flagged_hacking} flagged as hacking.`),
    el("table", { id: "suspects-table" },
      el("thead", {}, el("tr", {}, cols.map((c) => el("th", {}, c)))),
      el("tbody", {}, s.items.length ? s.items.map((r) => el("tr", { "data-rollout": r.rollout_id },
        el("td", {}, rid(r.rollout_id)), el("td", { class: "num" }, fmt(r.step)), el("td", {}, r.task_id),
        el("td", { class: "num" }, fmt(r.reward)), el("td", { class: "num" }, fmt(r.checks)),
        el("td", {}, rid(r.baseline.rollout_id)), el("td", { class: "num" }, fmt(r.baseline.reward)),
        el("td", { class: "num" }, fmt(r.baseline.checks)), el("td", { class: "num" }, fmt(r.rise)),
        el("td", {}, r.hacking ? el("span", { class: "badge break", title: JSON.stringify(r.hacking) }, "flagged") : ""))) :
        el("tr", {}, el("td", { colspan: cols.length, class: "muted" }, "no rollout's reward rose without its checks")))));
}

function pager(page, params) {
  const go = (offset) => { const p = new URLSearchParams(params); p.set("offset", offset); location.hash = `#/rollouts?${p}`; };
  const end = Math.min(page.offset + page.items.length, page.total);
  return el("div", { class: "pager" },
    el("button", { class: "prev", disabled: page.offset <= 0 ? "disabled" : null, onclick: () => go(Math.max(0, page.offset - PAGE)) }, "‹ previous"),
    el("span", { class: "range" }, page.total ? `${page.offset + 1}–${end} of ${page.total}` : "0 of 0"),
    el("button", { class: "next", disabled: end >= page.total ? "disabled" : null, onclick: () => go(page.offset + PAGE) }, "next ›"));
}

// ---- one rollout ----------------------------------------------------------------------------------
function tokenColor(mode, mask, lp, adv) {
  if (!mask) return "";
  if (mode === "mask") return "background:#dbeafe";
  if (mode === "logprob") return lp >= -0.5 ? "background:#bbf7d0" : lp >= -2.3 ? "background:#fef08a" : "background:#fecaca";
  const a = Math.max(-1, Math.min(1, (adv || 0) / 2));
  return a >= 0 ? `background:rgba(22,163,74,${0.12 + 0.5 * a})` : `background:rgba(220,38,38,${0.12 + 0.5 * -a})`;
}

function renderTokens(row, mode, adv) {
  const box = el("div", { class: "tokens", "data-row": row.index });
  const frag = document.createDocumentFragment();
  row.pieces.forEach((piece, i) => {
    const mask = row.loss_mask[i], lp = row.logprobs[i];
    const tlp = row.teacher_logprobs ? row.teacher_logprobs[i] : null;  // runs with train.teacher
    const shown = mode === "teacher" ? (tlp === null ? null : tlp - lp) : adv;
    frag.appendChild(el("span", { class: `m${mask}`, style: tokenColor(mode, mask, lp, shown),
      title: `#${i} id ${row.tokens[i]} mask ${mask}` + (mask ? ` logprob ${lp.toFixed(4)}` : "")
        + (mask && tlp !== null ? ` teacher ${tlp.toFixed(4)}` : "") }, piece));
  });
  box.appendChild(frag);
  return box;
}

function message(m) {
  return el("div", { class: "msg" }, el("div", { class: "role" }, m.role),
    m.content ? el("pre", {}, m.content) : null,
    (m.tool_calls || []).map((t) => el("div", { class: "tool" }, `${t.name}(${typeof t.arguments === "string" ? t.arguments : JSON.stringify(t.arguments)})`)));
}

// The judge's call (prompt, answer, verdict), the grader's step rewards and the harness's annotations
// (docs/credit.md); null when the rollout has none of them.
function creditView(c) {
  if (!c || (!c.judge && !c.step_rewards.length && !c.annotations.length)) return null;
  const target = (e) => (e.call !== null && e.call !== undefined ? `call ${e.call}` : `tool call ${e.tool_call_id}`);
  const box = el("div", { id: "credit" }, el("h2", {}, "credit"));
  const j = c.judge;
  if (j) {
    let verdict = "score" in j ? `score ${j.score}` : `ranking ${JSON.stringify(j.ranking)}: candidate ${j.candidate} at place ${j.place}`;
    if (j.digits) verdict += ` (expected digit; digits hold ${j.digit_mass} of the top 20: ${Object.entries(j.digits).map(([d, p]) => `${d}: ${p.toFixed(2)}`).join(", ")})`;
    box.appendChild(el("div", { class: "card", id: "judge" },
      el("div", { class: "head" }, el("strong", {}, `judge (${j.mode}, ${j.model})`), el("span", {}, verdict)),
      el("details", {}, el("summary", {}, `prompt (${(j.prompt || []).length} messages)`), (j.prompt || []).map(message)),
      el("div", { class: "msg answer" }, el("div", { class: "role" }, "judge answered"), el("pre", {}, j.answer || ""))));
  }
  const rows = c.step_rewards.map((s) => ["grader", target(s), fmt(s.value), ""]).concat(
    c.annotations.map((a) => ["annotation", target(a), a.value === null || a.value === undefined ? "–" : fmt(a.value) + (c.annotation_rewards_allowed ? "" : " (data)"), a.label || ""]));
  if (rows.length) {
    box.appendChild(el("table", { id: "steps" }, el("tr", {}, ["from", "target", "value", "label"].map((h) => el("th", {}, h))),
      rows.map((cells) => el("tr", {}, cells.map((x) => el("td", {}, x))))));
  }
  return box;
}

async function rolloutView(id) {
  const rep = await api(`/api/rollouts/${encodeURIComponent(id)}`);
  const r = rep.rollout;
  const out = el("div", { id: "view-rollout" },
    el("h1", {}, `rollout ${r.rollout_id} `, stateCell(r.state)),
    el("div", { class: "card" }, el("dl", { class: "kv" },
      el("dt", {}, "task"), el("dd", {}, r.task_id),
      el("dt", {}, "step"), el("dd", {}, r.eval_label || (r.step !== null ? link(`step ${r.step}`, `#/rollouts?step=${r.step}`) : "–")),
      el("dt", {}, "group"), el("dd", {}, r.group_id || "–"),
      el("dt", {}, "reward"), el("dd", { id: "reward" }, fmt(r.reward), r.reward_details ? el("span", { class: "muted" }, "  " + JSON.stringify(r.reward_details)) : ""),
      el("dt", {}, "advantage"), el("dd", {}, fmt(r.advantage)),
      el("dt", {}, "attempts"), el("dd", {}, r.attempt_details.map((a) => el("div", {}, `#${a.attempt} ${a.status}` + (a.exit_code !== null ? ` exit ${a.exit_code}` : "") + (a.error ? ` — ${a.error}` : "") + `  (${a.folder})`))),
      el("dt", {}, "input"), el("dd", {}, el("pre", {}, JSON.stringify(r.input, null, 1))),
      el("dt", {}, "tokenizer"), el("dd", { class: "muted" }, rep.tokenizer))));
  const credit = creditView(rep.credit);
  if (credit) out.appendChild(credit);
  out.appendChild(el("h2", {}, `calls (${rep.calls.length})`));
  const calls = el("div", { id: "calls" });
  rep.calls.forEach((c) => {
    let k = c.messages.length;  // the messages after the model's last turn: what is new in this call
    while (k > 0 && c.messages[k - 1].role !== "assistant") k -= 1;
    const news = c.messages.slice(k);
    calls.appendChild(el("div", { class: "card call", "data-call": c.index },
      el("div", { class: "head" },
        el("strong", {}, `call ${c.index}`), el("span", {}, `attempt ${c.attempt}`), stateCell(c.status === "ok" ? "succeeded" : "failed"),
        el("span", { class: "muted" }, `${c.status} · finish ${c.finish_reason || "–"}${c.policy ? ` · policy ${c.policy}` : ""} · weights v${c.weight_version ?? "–"} · ${c.prompt_tokens}+${c.completion_tokens} tokens · ${fmt(c.latency_s, 2)}s`),
        c.row !== null ? el("span", { class: "badge" }, `row ${c.row}`) : el("span", { class: "badge bad" }, "no row"),
        c.break_cause ? el("span", { class: "badge break", title: "this call could not extend the previous row" }, `break: ${c.break_cause}`) : null),
      c.error ? el("div", { class: "error" }, c.error) : null,
      el("details", {}, el("summary", {}, `conversation sent (${c.messages.length} messages${c.tools.length ? `, tools: ${c.tools.join(", ")}` : ""})`),
        c.messages.map(message)),
      news.length ? el("div", { class: "muted" }, "new messages:") : null, news.map(message),
      el("div", { class: "msg answer" }, el("div", { class: "role" }, "completion"), el("pre", {}, c.completion_text),
        c.tool_calls.map((t) => el("div", { class: "tool" }, `${t.name}(${typeof t.arguments === "string" ? t.arguments : JSON.stringify(t.arguments)})`)))));
  });
  out.appendChild(calls);
  out.appendChild(el("h2", {}, `rows (${rep.rows.length})`));
  let mode = "mask";
  const rowsBox = el("div", { id: "rows" });
  const legend = { mask: "blue: trainable (loss mask 1) · grey: prompt and tool output (mask 0)",
    logprob: "trainable tokens by the engine's logprob: green ≥ −0.5 · yellow ≥ −2.3 · red below",
    advantage: "trainable tokens by the rollout's advantage: green positive · red negative",
    teacher: "trainable tokens by teacher − student logprob (the distillation advantage): green the teacher likes it more · red less" };
  const legendBox = el("span", { class: "muted", id: "legend" }, legend[mode]);
  const draw = () => {
    rowsBox.replaceChildren();
    legendBox.textContent = legend[mode];
    rep.rows.forEach((row) => {
      const first = rep.calls.find((c) => c.index === row.calls[0]);
      rowsBox.appendChild(el("div", { class: "row-head" }, el("strong", {}, `row ${row.index}`),
        el("span", { class: "muted" }, `attempt ${row.attempt} · calls ${row.calls.join(", ")} · ${row.n_tokens} tokens, ${row.n_trainable} trainable · weights ${row.weight_versions.map((v) => `v${v}`).join(" ")}${row.policy ? ` · policy ${row.policy}` : ""}`),
        first && first.break_cause ? el("span", { class: "badge break" }, `starts after break: ${first.break_cause}`) : null));
      rowsBox.appendChild(renderTokens(row, mode, r.advantage));
    });
    // the sampled tokens come after the prompt: open each row's box at its first trainable token
    requestAnimationFrame(() => rowsBox.querySelectorAll(".tokens").forEach((box) => {
      const first = box.querySelector("span.m1");
      if (first) box.scrollTop = Math.max(0, first.offsetTop - 60);
    }));
  };
  out.appendChild(el("div", { class: "modes", id: "modes" }, "colour by: ",
    ["mask", "logprob", "advantage", ...(rep.rows.some((row) => row.teacher_logprobs) ? ["teacher"] : [])].map((m) => el("label", {}, el("input", { type: "radio", name: "mode", value: m, checked: m === mode ? "checked" : null,
      onchange: () => { mode = m; draw(); } }), m)), legendBox));
  draw();
  out.appendChild(rowsBox);
  return out;
}

// ---- routing and live updates ---------------------------------------------------------------------
async function render() {
  if (rendering) return;
  rendering = true;
  const { path, params } = parseHash();
  try {
    let view;
    if (path.startsWith("/rollout/")) view = await rolloutView(decodeURIComponent(path.slice(9)));
    else if (path === "/rollouts") view = await rolloutsView(params);
    else if (path === "/suspects") view = await suspectsView(params);
    else view = await runView();
    const y = window.scrollY;
    app.replaceChildren(view);
    window.scrollTo(0, y);
  } catch (e) {
    app.replaceChildren(el("div", { class: "error", id: "error" }, String(e.message || e)));
  } finally {
    rendering = false;
    document.body.setAttribute("data-ready", String(Date.now()));
    document.body.setAttribute("data-ready-ms", String(Math.round(performance.now())));  // since navigation
  }
}

async function title() {
  try {
    runOnce = api("/api/run");
    const run = await runOnce;
    document.getElementById("run-title").textContent = `${run.name || ""} ${run.run_id || ""}  ·  ${run.run_dir}`;
  } catch (e) { /* the view shows the error */ }
}

function live() {
  if (!window.EventSource) return;
  const dot = document.getElementById("live");
  const src = new EventSource("/api/live");
  src.onmessage = (ev) => {
    dot.classList.add("on");
    dot.title = `live: last change seen ${new Date().toLocaleTimeString()}`;
    const token = ev.data;
    const { path } = parseHash();
    if (liveToken !== null && token !== liveToken && !path.startsWith("/rollout/")) render();
    liveToken = token;
  };
  src.onerror = () => dot.classList.remove("on");
}

window.addEventListener("hashchange", () => { runOnce = null; window.scrollTo(0, 0); render(); });
title();
render();
live();
