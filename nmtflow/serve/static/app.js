// nmtflow serve: the information-flow explorer. Plain modern JS, no build step; Plotly.js draws the heat maps.
// It reads /api/models once, then for each chosen model POSTs /api/translate (n-best) and /api/flow (one
// sentence's attention, gates and bridge, see the serve contract) and renders one panel per model.
"use strict";

const SLOT_ORDER = ["decoder.cross_attn", "encoder.self_attn", "decoder.self_attn"];
const SCALE = [[0, "#f7fbff"], [0.15, "#c6dbef"], [0.4, "#6baed6"], [0.7, "#2171b5"], [1, "#08306b"]];
const GATE_SCALE = [[0, "#fff5eb"], [0.5, "#fd8d3c"], [1, "#7f2704"]];
const HIGHLIGHT = "#e6550d";
const PLOT_CONFIG = {displaylogo: false, responsive: false,
                     modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"]};
const FONT = {family: "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size: 11, color: "#1f2933"};

// ---- small helpers ----------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

function clamp(x, lo, hi) { return Math.min(hi, Math.max(lo, x)); }
// Plotly reads tags and entities in its strings (</s> would vanish): escape every label it draws.
function esc(text) { return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }
function short(label, n = 14) { return esc(label.length > n ? label.slice(0, n - 1) + "…" : label); }
function pct(x) { return `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`; }
function maxOf(rows) { let m = 0; for (const r of rows) for (const v of r) if (v > m) m = v; return m; }
function mean(mats) {  // [H][T][S] → [T][S]
  return mats[0].map((row, t) => row.map((_, s) => mats.reduce((acc, m) => acc + m[t][s], 0) / mats.length));
}
function hcat(a, b, gap) {  // rows of a, [null]*gap, rows of b
  return a.map((row, t) => row.concat(Array(gap).fill(null), b[t]));
}

async function api(path, body) {
  let response;
  try {
    response = await fetch(path, body === undefined ? {} : {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  } catch (err) {
    throw new Error(`The server did not answer (${err.message}).`);
  }
  let payload = null;
  try { payload = await response.json(); } catch (_) { /* not JSON: reported below */ }
  if (!response.ok) {
    throw new Error((payload && payload.error) || `${path} answered HTTP ${response.status}.`);
  }
  if (payload === null) throw new Error(`${path} answered something that is not JSON.`);
  return payload;
}

function showError(node, message) {
  node.textContent = message;
  node.hidden = !message;
}

// ---- the form: served models, languages, options ----------------------------------------------------------
const models = new Map();  // name → the /api/models entry

function languageSelect(name, langs, chosen) {
  return el("select", {name, "aria-label": name},
            langs.map(l => el("option", {value: l, selected: l === chosen}, l)));
}

function modelRow(m, checked) {
  const langs = m.multilingual && m.src_langs && m.tgt_langs ? el("span", {class: "langs"},
    languageSelect("src_lang", m.src_langs, m.src_langs[0]), " → ",
    languageSelect("tgt_lang", m.tgt_langs, m.tgt_langs.find(l => l !== m.src_langs[0]) || m.tgt_langs[0])) : null;
  const flow = m.flow.length ? m.flow.join(", ") : "no flow to show";
  return el("div", {class: "model-row", dataset: {model: m.name}},
    el("label", {}, el("input", {type: "checkbox", name: "model", value: m.name, checked}),
       el("strong", {}, m.name), el("span", {class: `badge arch-${m.architecture}`}, m.architecture),
       el("span", {class: "muted"}, `${m.checkpoint} · ${flow}`)),
    langs);
}

async function loadModels() {
  const box = document.getElementById("models");
  const status = document.getElementById("models-status");
  try {
    const {models: list} = await api("/api/models");
    list.forEach(m => models.set(m.name, m));
    status.remove();
    if (!list.length) box.append(el("p", {class: "error"}, "The server has no model loaded."));
    list.forEach((m, i) => box.append(modelRow(m, i === 0)));
  } catch (err) {
    status.className = "error";
    status.textContent = `Could not list the models: ${err.message}`;
  }
}

function chosenModels() {
  return [...document.querySelectorAll(".model-row")]
    .filter(row => row.querySelector("input[name=model]").checked)
    .map(row => {
      const src = row.querySelector("select[name=src_lang]");
      const tgt = row.querySelector("select[name=tgt_lang]");
      return {name: row.dataset.model, src_lang: src ? src.value : null, tgt_lang: tgt ? tgt.value : null};
    });
}

async function onSubmit(event) {
  event.preventDefault();
  const formError = document.getElementById("form-error");
  const sentence = document.getElementById("sentence").value.trim();
  const target = document.getElementById("target").value.trim();
  const chosen = chosenModels();
  const beam = parseInt(document.getElementById("beam").value, 10) || null;  // null: each checkpoint's own
  const nbest = parseInt(document.getElementById("nbest").value, 10) || 1;
  if (!sentence) return showError(formError, "Type a source sentence to translate.");
  if (!chosen.length) return showError(formError, "Pick at least one model.");
  showError(formError, "");
  const button = document.getElementById("translate");
  button.disabled = true;
  const results = document.getElementById("results");
  results.replaceChildren();
  try {
    await Promise.all(chosen.map(c => {
      const panel = new Panel(models.get(c.name), c);
      results.append(panel.node);
      return panel.run(sentence, target || null, beam, nbest);
    }));
  } finally {
    button.disabled = false;
  }
}

// ---- one model's panel -----------------------------------------------------------------------------------
class Panel {
  constructor(model, choice) {
    this.model = model;
    this.choice = choice;
    this.slots = [];  // SlotView per attention slot
    const direction = choice.src_lang ? `${choice.src_lang} → ${choice.tgt_lang}` : null;
    this.error = el("div", {class: "error", role: "alert", hidden: true});
    this.translation = el("div", {class: "translation"}, el("p", {class: "muted"}, "Translating…"));
    this.flow = el("div", {class: "flow"}, el("p", {class: "muted"}, "Computing the flow…"));
    this.node = el("section", {class: "panel card", dataset: {model: model.name}},
      el("header", {class: "panel-head"},
         el("h2", {}, model.name), el("span", {class: `badge arch-${model.architecture}`}, model.architecture),
         direction && el("span", {class: "direction"}, direction),
         el("span", {class: "muted"}, model.checkpoint)),
      this.error, this.translation, this.flow);
  }

  request(extra) {
    return {model: this.model.name, src_lang: this.choice.src_lang, tgt_lang: this.choice.tgt_lang, ...extra};
  }

  async run(sentence, target, beam, nbest) {
    const errors = [];
    const beamSize = beam || this.model.beam_size;  // the flow's translation is the first of these hypotheses
    const translate = api("/api/translate", this.request({sentences: [sentence], beam_size: beamSize,
                                                          nbest: Math.min(nbest, beamSize)}))
      .then(r => this.renderTranslation(r.translations[0].hypotheses))
      .catch(err => { errors.push(err.message); this.translation.replaceChildren(); });
    const flow = api("/api/flow", this.request({sentence, target, beam_size: beamSize}))
      .then(r => this.renderFlow(r, target))
      .catch(err => { errors.push(err.message); this.flow.replaceChildren(); });
    await Promise.all([translate, flow]);
    showError(this.error, [...new Set(errors)].join(" "));
    this.node.dataset.state = errors.length ? "error" : "done";  // what a test or a screenshot waits for
  }

  renderTranslation(hypotheses) {
    this.translation.replaceChildren(
      el("ol", {class: "nbest"}, hypotheses.map(h => el("li", {},
        el("span", {class: "hyp"}, h.text), el("span", {class: "score", title: "length-normalised log-probability"},
                                               h.score.toFixed(2))))));
  }

  renderFlow(flow, target) {
    this.data = flow;
    const parts = [];
    parts.push(el("p", {class: "muted flow-for"}, target ? "Flow of the reference target: " :
                  "Flow of the model's translation: ", el("q", {}, flow.translation)));
    this.sourceChips = flow.source_tokens.map((t, i) => el("span", {class: "chip", dataset: {index: i}}, t));
    this.targetChips = flow.target_tokens.map((t, i) => el("span", {class: "chip", dataset: {index: i}}, t));
    this.hint = el("p", {class: "hint muted"});
    parts.push(el("div", {class: "tokens"},
      el("div", {class: "chip-row source"}, el("span", {class: "row-label"}, "source"), this.sourceChips),
      el("div", {class: "chip-row target"}, el("span", {class: "row-label"}, "target"), this.targetChips),
      this.hint));
    this.targetChips.forEach((chip, t) => {
      chip.addEventListener("mouseenter", () => this.hoverTarget(t));
      chip.addEventListener("mouseleave", () => this.clearHover());
    });
    this.sourceChips.forEach((chip, s) => {
      chip.addEventListener("mouseenter", () => this.hoverSource(s));
      chip.addEventListener("mouseleave", () => this.clearHover());
    });

    const empty = !flow.attention.length && !flow.gates.length && !flow.bridge;
    if (empty) {
      parts.push(el("p", {class: "notice"}, `A ${flow.architecture} model has no attention modules, shortcut ` +
                    "gates or attention bridge to show; only its translation is shown."));
    }
    const bySlot = new Map();
    for (const entry of flow.attention) {
      if (!bySlot.has(entry.slot)) bySlot.set(entry.slot, []);
      bySlot.get(entry.slot).push(entry);
    }
    const order = s => (SLOT_ORDER.indexOf(s) + SLOT_ORDER.length + 1) % (SLOT_ORDER.length + 1);
    const slotNames = [...bySlot.keys()].sort((a, b) => order(a) - order(b));
    const sections = el("div", {class: "sections"});
    parts.push(sections);
    this.flow.replaceChildren(...parts);
    for (const slot of slotNames) {
      const view = new SlotView(this, slot, bySlot.get(slot));
      this.slots.push(view);
      sections.append(view.node);
      view.draw();
    }
    if (flow.bridge) sections.append(bridgeSection(flow.bridge));
    if (flow.gates.length) sections.append(gatesSection(flow.gates));
    this.cross = this.slots.find(v => v.slot === "decoder.cross_attn") || null;
    const via = this.data.bridge && this.cross && this.cross.colSide !== "source" ? ", through the bridge's A," : "";
    this.hint.textContent = this.crossToSource() ? `Hover a target token: the source is shaded by its ` +
      `cross-attention${via} (mean over the heads of the layer picked below) and its row is outlined in the ` +
      "target-side maps. Hover a source token for the reverse." :
      "Hover a token to outline its row in the maps (this model has no cross-attention onto the source tokens).";
    this.node.querySelectorAll("section.plot-section").forEach(s => s.dispatchEvent(new Event("drawn")));
  }

  // Cross-attention of the picked layer, mean over heads, token half: (T × S_source). A bridge decoder attends
  // to the k rows of M, so its weights go through the bridge's A (k × S) to reach the source tokens.
  crossToSource() {
    if (!this.cross) return null;
    const w = mean(this.cross.entry().weights["1"]);
    const bridge = this.data.bridge, S = this.sourceChips.length;
    if (this.cross.colSide === "source") return w;
    if (bridge && w[0].length === bridge.heads && bridge.keys.length === S) {
      return w.map(row => bridge.weights[0].map((_, s) => row.reduce((acc, v, k) => acc + v * bridge.weights[k][s], 0)));
    }
    return null;
  }

  hoverTarget(t) {
    this.clearHover();
    this.targetChips[t].classList.add("focus");
    const w = this.crossToSource();
    if (w) shade(this.sourceChips, w[t]);
    this.slots.forEach(v => v.highlight("target", t));
  }

  hoverSource(s) {
    this.clearHover();
    this.sourceChips[s].classList.add("focus");
    const w = this.crossToSource();
    if (w) shade(this.targetChips, w.map(row => row[s]));
    this.slots.forEach(v => v.highlight("source", s));
  }

  clearHover() {
    [...this.sourceChips, ...this.targetChips].forEach(c => {
      c.classList.remove("focus", "shaded");
      c.style.background = "";
      delete c.dataset.weight;
      delete c.dataset.pct;
      c.removeAttribute("title");
    });
    this.slots.forEach(v => v.highlight(null, -1));
  }
}

function shade(chips, weights) {
  const top = Math.max(...weights, 1e-9);
  chips.forEach((chip, i) => {
    const w = weights[i] ?? 0;
    chip.classList.add("shaded");
    chip.dataset.weight = w.toFixed(4);
    chip.dataset.pct = w >= 0.005 ? pct(w) : "";
    chip.title = `attention ${w.toFixed(3)}`;
    chip.style.background = `rgba(33, 113, 181, ${(0.85 * w / top).toFixed(3)})`;
    chip.classList.toggle("dark", w / top > 0.55);
  });
}

// ---- one attention slot: a layer/head picker, the focused map, and every layer × head as a grid ------------
class SlotView {
  constructor(panel, slot, entries) {
    this.panel = panel;
    this.slot = slot;
    this.entries = entries.slice().sort((a, b) => a.layer - b.layer);
    this.heads = this.entries[0].heads;
    this.phrasal = this.entries[0].ngrams.some(n => n > 1);
    this.rowSide = slot.startsWith("encoder.") ? "source" : "target";
    const keys = this.entries[0].keys["1"], src = panel.data.source_tokens;  // a bridge decoder's keys: M1..Mk
    this.colSide = slot === "decoder.cross_attn" && keys.length === src.length && keys.every((k, i) => k === src[i])
      ? "source" : null;
    this.layerPick = el("select", {class: "pick-layer", "aria-label": "layer"},
      this.entries.map((e, i) => el("option", {value: i, selected: i === this.entries.length - 1}, `layer ${e.layer}`)));
    this.headPick = el("select", {class: "pick-head", "aria-label": "head"},
      el("option", {value: "mean"}, "mean of heads"),
      Array.from({length: this.heads}, (_, h) => el("option", {value: h}, `head ${h + 1}`)));
    this.layerPick.addEventListener("change", () => this.drawFocus());
    this.headPick.addEventListener("change", () => this.drawFocus());
    this.share = el("span", {class: "share"});
    this.focus = el("div", {class: "focus-plot"});
    this.grid = el("div", {class: "grid-plot"});
    const title = this.entries[0].title || slot;
    this.node = el("section", {class: "plot-section slot", dataset: {slot}},
      el("div", {class: "section-head"}, el("h3", {}, title), el("code", {class: "muted"}, slot),
         el("span", {class: "controls"}, this.layerPick, this.headPick), this.share),
      this.phrasal ? el("p", {class: "muted small"}, `Phrasal attention over n-grams ${this.entries[0].ngrams
        .join(", ")}: the token half (n = 1) left, the phrase half (n ≥ 2) right, on one colour scale.`) : null,
      this.focus,
      el("details", {class: "all-heads", open: true},
         el("summary", {}, `All ${this.entries.length} layers × ${this.heads} heads (click one to focus it)`),
         this.grid));
    this.hl = null;
  }

  entry() { return this.entries[Number(this.layerPick.value)]; }

  queries() { return this.entries[0].queries; }

  // (T × S_n) of the picked head (or the mean of heads) of an entry, per n.
  matrices(entry, head) {
    const out = {};
    for (const [n, w] of Object.entries(entry.weights)) out[n] = head === "mean" ? mean(w) : w[head];
    return out;
  }

  phraseHalf(entry, mats) {  // the n ≥ 2 blocks side by side, with their labels and block bounds
    const ns = entry.ngrams.filter(n => n > 1 && mats[n] && mats[n][0] && mats[n][0].length);
    const rows = this.queries().map((_, t) => ns.flatMap(n => mats[n][t]));
    const labels = ns.flatMap(n => entry.keys[String(n)]);
    const bounds = [];
    let acc = 0;
    ns.forEach(n => { acc += entry.keys[String(n)].length; bounds.push(acc); });
    return {ns, rows, labels, bounds: bounds.slice(0, -1)};
  }

  draw() {
    this.drawFocus();
    this.drawGrid();
  }

  drawFocus() {
    const entry = this.entry();
    const head = this.headPick.value === "mean" ? "mean" : Number(this.headPick.value);
    const mats = this.matrices(entry, head);
    const share = head === "mean" ? entry.layer_phrase_share : entry.phrase_share[head];
    this.share.textContent = this.phrasal ? `phrase share ${pct(share)}` : "";
    const rows = this.queries();
    const halves = [{z: mats["1"], labels: entry.keys["1"], name: "token-to-token", bounds: []}];
    if (this.phrasal) {
      const ph = this.phraseHalf(entry, mats);
      if (ph.labels.length) {
        halves.push({z: ph.rows, labels: ph.labels, bounds: ph.bounds,
                     name: `token-to-phrase (${ph.ns.map(n => `${n}-grams`).join(", ")})`});
      }
    }
    const zmax = Math.max(1e-6, ...halves.map(h => maxOf(h.z)));
    const cols = halves.reduce((acc, h) => acc + h.labels.length, 0);
    const left = 12 + 6.5 * Math.max(...rows.map(r => Math.min(r.length, 14)));
    const bottom = 30 + 5.5 * Math.max(...halves.flatMap(h => h.labels.map(l => Math.min(l.length, 14))));
    const room = (this.node.clientWidth || 900) - left - 110;
    const px = clamp(room / (cols + 2 * (halves.length - 1)), 10, 26);
    const gapFrac = halves.length > 1 ? 2 * px / (cols * px + 2 * px) : 0;
    const traces = [];
    const layout = {font: FONT, margin: {l: left, r: 10, t: 34, b: bottom}, height: 34 + bottom + px * rows.length,
                    width: left + 110 + px * (cols + 2 * (halves.length - 1)),
                    coloraxis: {colorscale: SCALE, cmin: 0, cmax: zmax, colorbar: {thickness: 12, len: 0.9}},
                    annotations: [], shapes: [], paper_bgcolor: "rgba(0,0,0,0)"};
    let start = 0;
    halves.forEach((h, i) => {
      const suffix = i ? String(i + 1) : "";
      const width = (1 - gapFrac) * h.labels.length / cols;
      layout[`xaxis${suffix}`] = {domain: [start, start + width], tickvals: h.labels.map((_, j) => j),
        ticktext: h.labels.map(l => short(l)), tickangle: -60, showgrid: false, zeroline: false, anchor: "y"};
      traces.push({type: "heatmap", z: h.z, xaxis: `x${suffix}`, yaxis: "y", coloraxis: "coloraxis", xgap: 0.5,
        ygap: 0.5, text: rows.map(r => h.labels.map(k => esc(`${r} → ${k}`))),
        hovertemplate: "%{text}<br>%{z:.3f}<extra></extra>"});
      layout.annotations.push({text: h.name, xref: "paper", yref: "paper", x: start + width / 2, y: 1,
                               yanchor: "bottom", showarrow: false, font: {size: 11}});
      h.bounds.forEach(b => layout.shapes.push({type: "line", xref: `x${suffix}`, yref: "paper", x0: b - 0.5,
        x1: b - 0.5, y0: 0, y1: 1, line: {color: "#fff", width: 2}}));
      start += width + gapFrac;
    });
    layout.yaxis = {tickvals: rows.map((_, t) => t), ticktext: rows.map(r => short(r)), autorange: "reversed",
                    showgrid: false, zeroline: false};
    this.focusHalves = halves.length;
    this.focusShapes = layout.shapes;
    Plotly.react(this.focus, traces, layout, PLOT_CONFIG).then(() => this.applyHighlight());
    if (this.panel.cross === this) this.panel.clearHover();
  }

  drawGrid() {
    const L = this.entries.length, H = this.heads, rows = this.queries();
    const width = Math.min(this.node.clientWidth || 900, 60 + H * 150);
    const cellW = (width - 60) / H;
    const sample = this.gridCell(this.entries[0], 0);
    const cellH = clamp(cellW * rows.length / Math.max(sample[0].length, 1), 36, 150);
    const gx = 0.012, gy = 8;
    const height = L * (cellH + gy) + 30;
    const layout = {font: FONT, width, height, margin: {l: 56, r: 4, t: 24, b: 6}, showlegend: false,
                    annotations: [], shapes: [], paper_bgcolor: "rgba(0,0,0,0)"};
    const traces = [];
    this.entries.forEach((entry, li) => {
      for (let h = 0; h < H; h++) {
        const k = li * H + h + 1, suffix = k === 1 ? "" : String(k);
        const y1 = 1 - li / L, y0 = 1 - (li + 1) / L + gy / (height - 30);
        layout[`xaxis${suffix}`] = {domain: [h / H + gx, (h + 1) / H - gx], anchor: `y${suffix}`, visible: false,
                                    fixedrange: true};
        layout[`yaxis${suffix}`] = {domain: [y0, y1], anchor: `x${suffix}`, visible: false, autorange: "reversed",
                                    fixedrange: true};
        const z = this.gridCell(entry, h);
        traces.push({type: "heatmap", z, xaxis: `x${suffix}`, yaxis: `y${suffix}`, colorscale: SCALE, zmin: 0,
                     zmax: Math.max(1e-6, maxOf(z)), showscale: false, name: `layer ${entry.layer}, head ${h + 1}`,
                     hovertemplate: `layer ${entry.layer}, head ${h + 1}<br>%{z:.3f}<extra></extra>`,
                     meta: {layer: li, head: h}});
        if (li === 0) layout.annotations.push({text: `head ${h + 1}`, xref: "paper", yref: "paper",
          x: (h + 0.5) / H, y: 1, yanchor: "bottom", showarrow: false});
      }
      layout.annotations.push({text: `layer ${entry.layer}`, xref: "paper", yref: "paper", x: 0, xanchor: "right",
        y: 1 - (li + 0.5) / L, showarrow: false});
    });
    this.gridShapes = [];
    Plotly.react(this.grid, traces, layout, PLOT_CONFIG).then(() => {
      if (this.grid.removeAllListeners) this.grid.removeAllListeners("plotly_click");
      this.grid.on("plotly_click", ev => {
        const meta = ev.points[0].data.meta;
        this.layerPick.value = String(meta.layer);
        this.headPick.value = String(meta.head);
        this.drawFocus();
        this.focus.scrollIntoView({behavior: "smooth", block: "nearest"});
      });
    });
  }

  gridCell(entry, head) {  // token half | a gap column | phrase half, one head
    const mats = this.matrices(entry, head);
    if (!this.phrasal) return mats["1"];
    const ph = this.phraseHalf(entry, mats);
    return ph.labels.length ? hcat(mats["1"], ph.rows, 1) : mats["1"];
  }

  // Outline row/column `index` of the maps whose rows (or token-half columns) are tokens of `side`.
  highlight(side, index) {
    this.hl = side === null ? null : {side, index};
    this.applyHighlight();
  }

  applyHighlight() {
    if (!this.focus.data) return;
    const hl = this.hl;
    const line = {color: HIGHLIGHT, width: 2};
    const focusExtra = [], gridExtra = [];
    if (hl && hl.side === this.rowSide) {
      for (let i = 0; i < this.focusHalves; i++) {
        const s = i ? String(i + 1) : "";
        const n = this.focus.data[i].z[0].length;
        focusExtra.push({type: "rect", xref: `x${s}`, yref: "y", x0: -0.5, x1: n - 0.5, y0: hl.index - 0.5,
                         y1: hl.index + 0.5, line});
      }
      if (this.grid.data) {
        this.grid.data.forEach((tr, k) => {
          const s = k ? String(k + 1) : "";
          gridExtra.push({type: "rect", xref: `x${s}`, yref: `y${s}`, x0: -0.5, x1: tr.z[0].length - 0.5,
                          y0: hl.index - 0.5, y1: hl.index + 0.5, line: {color: HIGHLIGHT, width: 1.5}});
        });
      }
    } else if (hl && hl.side === this.colSide) {
      focusExtra.push({type: "rect", xref: "x", yref: "paper", x0: hl.index - 0.5, x1: hl.index + 0.5, y0: 0,
                       y1: 1, line});
    }
    Plotly.relayout(this.focus, {shapes: this.focusShapes.concat(focusExtra)});
    if (this.grid.data && (gridExtra.length || this.gridShown)) {
      this.gridShown = gridExtra.length > 0;
      Plotly.relayout(this.grid, {shapes: gridExtra});
    }
  }
}

// ---- the attention bridge and the lexical-shortcut gates ------------------------------------------------
function heatSection(title, subtitle, z, rows, cols, {scale = SCALE, zmax = null, slot = null} = {}) {
  const plot = el("div", {class: "plot"});
  const node = el("section", {class: "plot-section", dataset: slot ? {slot} : {}},
    el("div", {class: "section-head"}, el("h3", {}, title)), el("p", {class: "muted small"}, subtitle), plot);
  node.addEventListener("drawn", () => {
    const left = 12 + 6.5 * Math.max(...rows.map(r => r.length));
    const bottom = 30 + 5.5 * Math.max(...cols.map(c => Math.min(c.length, 14)));
    const px = clamp(((node.clientWidth || 900) - left - 110) / cols.length, 10, 26);
    Plotly.newPlot(plot, [{type: "heatmap", z, colorscale: scale, zmin: 0,
      zmax: zmax ?? Math.max(1e-6, maxOf(z)), xgap: 0.5, ygap: 0.5, colorbar: {thickness: 12},
      text: rows.map(r => cols.map(c => esc(`${r} · ${c}`))), hovertemplate: "%{text}<br>%{z:.3f}<extra></extra>"}],
      {font: FONT, margin: {l: left, r: 10, t: 10, b: bottom}, width: left + 110 + px * cols.length,
       height: 10 + bottom + Math.max(px, 16) * rows.length, paper_bgcolor: "rgba(0,0,0,0)",
       xaxis: {tickvals: cols.map((_, j) => j), ticktext: cols.map(c => short(c)), tickangle: -60, showgrid: false},
       yaxis: {tickvals: rows.map((_, i) => i), ticktext: rows.map(r => esc(r)), autorange: "reversed", showgrid: false}},
      PLOT_CONFIG);
  }, {once: true});
  return node;
}

function bridgeSection(bridge) {
  const rows = Array.from({length: bridge.heads}, (_, k) => `M${k + 1}`);
  return heatSection("attention bridge", `The bridge's ${bridge.heads} attention heads over the source ` +
    "(A, one row per row of M; each row sums to 1).", bridge.weights, rows, bridge.keys, {slot: "bridge"});
}

function gatesSection(gates) {
  const bySlot = new Map();
  gates.forEach(g => { if (!bySlot.has(g.slot)) bySlot.set(g.slot, []); bySlot.get(g.slot).push(g); });
  const wrap = el("div", {class: "gates"});
  for (const [slot, list] of bySlot) {
    const sorted = list.slice().sort((a, b) => a.layer - b.layer || a.kind.localeCompare(b.kind));
    const rows = sorted.map(g => `layer ${g.layer} ${g.kind} (mean ${g.mean.toFixed(2)})`);
    const section = heatSection(`lexical-shortcut gates · ${slot}`, "Mean gate value over features per key " +
      "position: how much of the embeddings each layer's keys (r_k) and values (r_v) take in.",
      sorted.map(g => g.values), rows, sorted[0].keys, {scale: GATE_SCALE, zmax: 1, slot: `gates:${slot}`});
    wrap.append(section);
  }
  return wrap;
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("query").addEventListener("submit", onSubmit);
  loadModels();
});
