/* RustInfer console: chat with streaming tokens + a live panel of engine metrics.
 * Static, no build step. Talks to the server over its public HTTP API only:
 *   GET /v1/models, POST /v1/chat/completions (SSE), GET /ready, GET /metrics, GET /metrics/system (optional).
 * An API key typed into the header (kept in localStorage) goes with every request as `Authorization: Bearer`.
 * The API base URL comes from <meta name="rustinfer-api" content="...">; empty means same origin. */
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  const API_BASE = (() => {
    const meta = document.querySelector('meta[name="rustinfer-api"]');
    return ((meta && meta.getAttribute("content")) || "").trim().replace(/\/+$/, "");
  })();
  const api = (path) => API_BASE + path;
  const KEY_STORE = "rustinfer.api_key";
  // The server asks for the key on /v1/* (and /metrics when configured); /ready and /health ignore it.
  const authHeaders = () => {
    const key = (localStorage.getItem(KEY_STORE) || "").trim();
    return key ? { Authorization: "Bearer " + key } : {};
  };

  const POLL_MS = 1000;
  const HISTORY_S = 15 * 60 + 30; // the longest chart window plus a margin
  const THROUGHPUT_SMOOTH_S = 5;

  // ---------------------------------------------------------------------------------------------
  // Formatting
  // ---------------------------------------------------------------------------------------------
  const NA = "n/a";
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const fmtInt = (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : NA);
  const fmtPct = (v, digits = 1) => (isNum(v) ? (v * 100).toFixed(digits) + "%" : NA);
  const fmtRate = (v) => (isNum(v) ? (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + " tok/s" : NA);
  function fmtSecs(v) {
    if (!isNum(v)) return NA;
    if (v < 1) return Math.round(v * 1000) + " ms";
    return (v < 10 ? v.toFixed(2) : v.toFixed(1)) + " s";
  }
  function fmtUptime(s) {
    if (!isNum(s)) return NA;
    s = Math.max(0, Math.floor(s));
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
    if (d) return `${d}d ${h}h`;
    if (h) return `${h}h ${m}m`;
    if (m) return `${m}m ${s % 60}s`;
    return `${s}s`;
  }
  function fmtCompact(v) {
    if (!isNum(v)) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10 || Number.isInteger(v)) return v.toFixed(0);
    return v.toFixed(2);
  }

  // ---------------------------------------------------------------------------------------------
  // Prometheus text exposition format: name{label="value",...} value [timestamp]
  // ---------------------------------------------------------------------------------------------
  function parseNumber(s) {
    if (s === "+Inf" || s === "Inf") return Infinity;
    if (s === "-Inf") return -Infinity;
    if (s === "NaN") return NaN;
    const v = Number(s);
    return Number.isNaN(v) ? null : v;
  }

  /** Returns Map<metricName, Array<{labels: Object, value: number}>>. Malformed lines are skipped. */
  function parsePrometheus(text) {
    const out = new Map();
    for (const raw of text.split("\n")) {
      const line = raw.trim();
      if (!line || line[0] === "#") continue;
      const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)/.exec(line);
      if (!m) continue;
      const name = m[1];
      let i = name.length;
      const labels = {};
      if (line[i] === "{") {
        i++;
        let ok = false;
        while (i < line.length) {
          while (line[i] === " " || line[i] === ",") i++;
          if (line[i] === "}") { i++; ok = true; break; }
          const lm = /^([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"/.exec(line.slice(i));
          if (!lm) break;
          i += lm[0].length;
          let val = "";
          while (i < line.length && line[i] !== '"') {
            if (line[i] === "\\" && i + 1 < line.length) {
              const c = line[i + 1];
              val += c === "n" ? "\n" : c;
              i += 2;
            } else {
              val += line[i++];
            }
          }
          if (line[i] !== '"') break;
          i++;
          labels[lm[1]] = val;
        }
        if (!ok) continue;
      }
      const rest = line.slice(i).trim().split(/\s+/);
      const value = parseNumber(rest[0]);
      if (value === null) continue;
      if (!out.has(name)) out.set(name, []);
      out.get(name).push({ labels, value });
    }
    return out;
  }

  /** Sum of a metric over all its label sets, or null when the metric is absent. */
  function total(metrics, name) {
    const samples = name && metrics.get(name);
    if (!samples || !samples.length) return null;
    let s = 0;
    for (const x of samples) if (Number.isFinite(x.value)) s += x.value;
    return s;
  }

  /** The first name present among the candidates, else the first name matching the pattern. */
  function findName(metrics, candidates, pattern) {
    for (const c of candidates) if (metrics.has(c)) return c;
    if (pattern) for (const n of metrics.keys()) if (pattern.test(n)) return n;
    return null;
  }

  /** A histogram summed over its non-`le` labels: {sum, count, buckets: [[le, cumulative], ...]} or null. */
  function histogram(metrics, base) {
    if (!base) return null;
    const sum = total(metrics, base + "_sum"), count = total(metrics, base + "_count");
    if (sum === null || count === null) return null;
    const byLe = new Map();
    for (const s of metrics.get(base + "_bucket") || []) {
      const le = parseNumber(s.labels.le);
      if (le === null || Number.isNaN(le)) continue;
      byLe.set(le, (byLe.get(le) || 0) + s.value);
    }
    const buckets = [...byLe.entries()].sort((a, b) => a[0] - b[0]);
    return { sum, count, buckets };
  }

  /** Quantile q of the observations between two cumulative histogram readings (linear within a bucket). */
  function histogramQuantile(q, newer, older) {
    if (!newer || !newer.buckets.length) return null;
    const prev = new Map(older ? older.buckets : []);
    const deltas = newer.buckets.map(([le, c]) => [le, c - (prev.get(le) || 0)]);
    const n = deltas[deltas.length - 1][1];
    if (!(n > 0)) return null;
    const rank = q * n;
    let lowerLe = 0, lowerCount = 0;
    for (const [le, c] of deltas) {
      if (c >= rank) {
        if (!Number.isFinite(le)) return lowerLe; // in the +Inf bucket: the best bound we have
        const inBucket = c - lowerCount;
        return inBucket > 0 ? lowerLe + ((le - lowerLe) * (rank - lowerCount)) / inBucket : le;
      }
      lowerLe = le;
      lowerCount = c;
    }
    return lowerLe;
  }

  const GEN_TOKENS = ["rustinfer_generation_tokens_total", "rustinfer_generation_tokens", "rustinfer_num_generation_tokens_total"];
  const GEN_PATTERN = /generation_tokens(_total)?$/;
  const TTFT_BASES = ["rustinfer_time_to_first_token_seconds", "rustinfer_ttft_seconds", "rustinfer_request_ttft_seconds"];
  const TTFT_PATTERN = /(time_to_first_token|ttft)[a-z_]*_count$/;

  /** One reading of /metrics reduced to the numbers the panel shows (null where a metric is absent). */
  function reading(metrics) {
    let ttftBase = TTFT_BASES.find((b) => metrics.has(b + "_count")) || null;
    if (!ttftBase) {
      const n = findName(metrics, [], TTFT_PATTERN);
      ttftBase = n ? n.slice(0, -"_count".length) : null;
    }
    return {
      running: total(metrics, "rustinfer_num_requests_running"),
      waiting: total(metrics, "rustinfer_num_requests_waiting"),
      kv: total(metrics, "rustinfer_kv_cache_usage_ratio"),
      prefixQueries: total(metrics, findName(metrics, ["rustinfer_prefix_cache_queries_tokens_total", "rustinfer_prefix_cache_queries_total"])),
      prefixHits: total(metrics, findName(metrics, ["rustinfer_prefix_cache_hits_tokens_total", "rustinfer_prefix_cache_hits_total"])),
      preemptions: total(metrics, findName(metrics, ["rustinfer_num_preemptions_total", "rustinfer_num_preemptions"])),
      genTokens: total(metrics, findName(metrics, GEN_TOKENS, GEN_PATTERN)),
      ttft: histogram(metrics, ttftBase),
    };
  }

  // ---------------------------------------------------------------------------------------------
  // Live panel
  // ---------------------------------------------------------------------------------------------
  const samples = []; // {t: ms, ok: bool, ...reading}
  const live = {
    windowS: Number(localStorage.getItem("rustinfer.window")) || 300,
    systemNextAt: 0,
    systemMissing: false,
    lastError: "",
  };

  function rateBetween(a, b, key) {
    if (!a || !b || !isNum(a[key]) || !isNum(b[key])) return null;
    const dt = (b.t - a.t) / 1000;
    const dv = b[key] - a[key];
    if (dt <= 0 || dv < 0) return null; // dv < 0: the counter was reset (server restart)
    return dv / dt;
  }
  function ttftMeanBetween(a, b) {
    if (!a || !b || !a.ttft || !b.ttft) return null;
    const dc = b.ttft.count - a.ttft.count;
    if (!(dc > 0)) return null;
    return (b.ttft.sum - a.ttft.sum) / dc;
  }
  /** The oldest sample at or after time t (ms), or null. */
  function sampleAtOrAfter(t) {
    for (const s of samples) if (s.t >= t && s.ok) return s;
    return null;
  }

  function drawChart(id, series, opts) {
    const fig = $(id);
    const svg = fig.querySelector("svg");
    const W = 300, H = 60, PAD = 3;
    const now = opts.now, t0 = now - opts.windowS * 1000;
    let yMax = opts.yMax;
    if (!isNum(yMax)) {
      let m = 0;
      for (const s of series) for (const [, v] of s.points) if (isNum(v) && v > m) m = v;
      yMax = Math.max(opts.yMin || 1e-9, m * 1.15);
    }
    const x = (t) => ((t - t0) / (now - t0)) * W;
    const y = (v) => H - PAD - (Math.min(v, yMax) / yMax) * (H - 2 * PAD);
    const parts = [`<line class="grid" x1="0" x2="${W}" y1="${H - PAD}" y2="${H - PAD}"/>`,
                   `<line class="grid" x1="0" x2="${W}" y1="${PAD}" y2="${PAD}"/>`];
    for (const s of series) {
      const runs = [];
      let cur = [];
      for (const [t, v] of s.points) {
        if (t < t0) continue;
        if (isNum(v)) cur.push([x(t), y(v)]);
        else if (!s.connect && cur.length) { runs.push(cur); cur = []; }
      }
      if (cur.length) runs.push(cur);
      for (const run of runs) {
        const d = run.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
        if (s.fill && run.length > 1) {
          parts.push(`<path class="area ${s.cls}" d="${d}L${run[run.length - 1][0].toFixed(1)},${H - PAD}L${run[0][0].toFixed(1)},${H - PAD}Z"/>`);
        }
        if (run.length > 1) parts.push(`<path class="line ${s.cls}" d="${d}"/>`);
      }
      if (s.dots) {
        for (const run of runs) for (const [px, py] of run) parts.push(`<circle class="dot ${s.cls}" cx="${px.toFixed(1)}" cy="${py.toFixed(1)}" r="1.6"/>`);
      } else {
        for (const run of runs) if (run.length === 1) parts.push(`<circle class="dot ${s.cls}" cx="${run[0][0].toFixed(1)}" cy="${run[0][1].toFixed(1)}" r="1.6"/>`);
      }
    }
    svg.innerHTML = parts.join("");
    fig.querySelector(".scale-max").textContent = "max " + opts.fmtScale(yMax);
    const w = opts.windowS;
    fig.querySelector(".scale-win").textContent = "last " + (w % 60 === 0 ? w / 60 + " min" : w < 120 ? w + " s" : (w / 60).toFixed(1) + " min");
    fig.querySelector(".chart-value").textContent = opts.value;
  }

  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
    if (el.tagName === "DD") el.title = text; // may be cut with an ellipsis
  }

  function renderLive() {
    const now = Date.now();
    const last = samples.length ? samples[samples.length - 1] : null;
    const cur = last && last.ok ? last : null;

    setText("m-running", fmtInt(cur && cur.running));
    setText("m-waiting", fmtInt(cur && cur.waiting));
    setText("m-kv", fmtPct(cur && cur.kv));
    $("m-kv-bar").style.width = cur && isNum(cur.kv) ? Math.min(100, cur.kv * 100).toFixed(1) + "%" : "0";
    setText("m-gen", fmtInt(cur && cur.genTokens));
    setText("m-preempt", fmtInt(cur && cur.preemptions));
    if (cur && isNum(cur.prefixQueries) && isNum(cur.prefixHits) && cur.prefixQueries > 0) {
      setText("m-prefix", fmtPct(cur.prefixHits / cur.prefixQueries));
      setText("m-prefix-sub", `${fmtCompact(cur.prefixHits)}/${fmtCompact(cur.prefixQueries)} tok`);
    } else {
      setText("m-prefix", NA);
      setText("m-prefix-sub", cur && isNum(cur.prefixQueries) ? "no lookups yet" : "");
    }

    // The x axis spans the chosen window, or less while the history is younger (at least a minute), so that
    // a freshly opened console shows its readings across the chart rather than in a sliver at its right edge.
    const oldest = samples.length ? samples[0].t : now;
    const windowS = Math.min(live.windowS, Math.max(60, Math.ceil((now - oldest) / 10000) * 10));
    const common = { now, windowS };
    const pts = (f) => samples.map((s, i) => [s.t, s.ok ? f(s, i) : null]);

    drawChart("chart-requests", [
      { points: pts((s) => s.running), cls: "a", fill: true },
      { points: pts((s) => s.waiting), cls: "b" },
    ], { ...common, yMin: 1, fmtScale: fmtCompact,
         value: cur && (isNum(cur.running) || isNum(cur.waiting)) ? `${fmtInt(cur.running)} / ${fmtInt(cur.waiting)}` : NA });

    drawChart("chart-kv", [{ points: pts((s) => s.kv), cls: "a", fill: true }],
      { ...common, yMax: 1, fmtScale: (v) => fmtPct(v, 0), value: fmtPct(cur && cur.kv) });

    const prevOk = (i) => { for (let j = i - 1; j >= 0; j--) if (samples[j].ok) return samples[j]; return null; };
    const smoothFrom = sampleAtOrAfter(now - THROUGHPUT_SMOOTH_S * 1000 - 500);
    const tputNow = cur && isNum(cur.genTokens) ? rateBetween(smoothFrom !== cur ? smoothFrom : prevOk(samples.length - 1), cur, "genTokens") : null;
    drawChart("chart-tput", [{ points: pts((s, i) => rateBetween(prevOk(i), s, "genTokens")), cls: "a", fill: true }],
      { ...common, yMin: 1, fmtScale: (v) => fmtCompact(v) + " tok/s",
        value: cur && isNum(cur.genTokens) ? (isNum(tputNow) ? fmtRate(tputNow) : "…") : NA });

    const windowStart = sampleAtOrAfter(now - windowS * 1000);
    let ttftValue = NA;
    if (cur && cur.ttft) {
      const mean = ttftMeanBetween(windowStart, cur);
      const p90 = histogramQuantile(0.9, cur.ttft, windowStart && windowStart !== cur ? windowStart.ttft : null);
      const n = windowStart && windowStart.ttft ? cur.ttft.count - windowStart.ttft.count : 0;
      if (isNum(mean) && n > 0) ttftValue = `avg ${fmtSecs(mean)}` + (isNum(p90) ? ` · p90 ${fmtSecs(p90)}` : "");
      else ttftValue = windowStart && windowStart !== cur ? "no requests" : "…";
    }
    drawChart("chart-ttft", [{ points: pts((s, i) => ttftMeanBetween(prevOk(i), s)), cls: "a", connect: true, dots: true }],
      { ...common, yMin: 0.01, fmtScale: fmtSecs, value: ttftValue });
  }

  function setReady(kind, text, title) {
    const pill = $("ready-pill");
    pill.className = "pill pill-" + kind;
    setText("ready-pill", text);
    pill.title = title;
  }

  async function fetchWithTimeout(url, ms) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), ms);
    try {
      return await fetch(url, { signal: ctl.signal, cache: "no-store", headers: authHeaders() });
    } finally {
      clearTimeout(timer);
    }
  }

  async function pollReady() {
    try {
      const r = await fetchWithTimeout(api("/ready"), 3000);
      let detail = "";
      try { detail = (await r.text()).slice(0, 200); } catch (_) { /* ignore */ }
      if (r.ok) setReady("ok", "Ready", "GET /ready → " + r.status);
      else if (r.status === 503) setReady("warn", "Not ready", "GET /ready → 503 " + detail);
      else setReady("unknown", "Ready: n/a", "GET /ready → " + r.status + " " + detail);
    } catch (e) {
      setReady("bad", "Unreachable", "GET /ready failed: " + e);
    }
  }

  async function pollMetrics() {
    const t = Date.now();
    try {
      const r = await fetchWithTimeout(api("/metrics"), 3000);
      if (!r.ok) throw new Error("HTTP " + r.status);
      const rd = reading(parsePrometheus(await r.text()));
      samples.push({ t, ok: true, ...rd });
      live.lastError = "";
    } catch (e) {
      samples.push({ t, ok: false });
      live.lastError = "/metrics unavailable: " + (e && e.name === "AbortError" ? "timed out" : e.message || e);
    }
    while (samples.length && samples[0].t < t - HISTORY_S * 1000) samples.shift();
  }

  async function pollSystem() {
    const now = Date.now();
    if (now < live.systemNextAt) return;
    live.systemNextAt = now + 5000;
    try {
      const r = await fetchWithTimeout(api("/metrics/system"), 3000);
      if (!r.ok) throw new Error("HTTP " + r.status);
      const sys = await r.json();
      live.systemMissing = false;
      const str = (v) => (v === undefined || v === null || v === "" ? NA : String(v));
      setText("sys-model", str(sys.model));
      setText("sys-backend", str(sys.backend));
      setText("sys-device", str(sys.device));
      live.uptime = isNum(sys.uptime_s) ? { base: sys.uptime_s, at: now } : null;
    } catch (_) {
      live.systemMissing = true;
      live.uptime = null;
      live.systemNextAt = now + 30000; // optional endpoint: look again now and then
      for (const id of ["sys-backend", "sys-device"]) setText(id, NA);
      setText("sys-model", chat.model || NA);
    }
  }

  function renderUptime() {
    setText("sys-uptime", live.uptime ? fmtUptime(live.uptime.base + (Date.now() - live.uptime.at) / 1000) : NA);
  }

  async function liveTick() {
    const started = Date.now();
    await Promise.allSettled([pollMetrics(), pollReady(), pollSystem()]);
    renderUptime();
    try {
      renderLive();
    } catch (e) {
      console.error(e);
    }
    const took = Date.now() - started;
    const status = live.lastError
      ? live.lastError
      : `updated ${new Date().toLocaleTimeString("en-GB")} · ${took} ms` + (live.systemMissing ? " · /metrics/system n/a" : "");
    setText("live-status", status);
    $("live-status").classList.toggle("error-text", !!live.lastError);
    setTimeout(liveTick, Math.max(100, POLL_MS - took));
  }

  // ---------------------------------------------------------------------------------------------
  // Chat
  // ---------------------------------------------------------------------------------------------
  const chat = { history: [], busy: false, controller: null, model: "" };

  const messagesEl = $("messages");
  const promptEl = $("prompt");

  function nearBottom() {
    return messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < 80;
  }
  function scrollToBottom(force) {
    if (force || chat.stick) messagesEl.scrollTop = messagesEl.scrollHeight;
  }
  messagesEl.addEventListener("scroll", () => { chat.stick = nearBottom(); });
  chat.stick = true;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function addMessage(role, text) {
    $("empty-hint").hidden = true;
    const wrap = el("div", "msg msg-" + role);
    wrap.dataset.role = role;
    const who = el("div", "who", role === "user" ? "You" : role === "assistant" ? (chat.model || "Assistant") : role);
    const bubble = el("div", "bubble", text);
    wrap.append(who, bubble);
    messagesEl.append(wrap);
    scrollToBottom(true);
    return { wrap, bubble };
  }

  /** Shows an API error: HTTP status, OpenAI error type/code and message. */
  function addError(target, { status, type, code, message }) {
    const box = el("div", "api-error");
    box.setAttribute("role", "alert");
    box.dataset.testid = "api-error";
    const head = [status ? "HTTP " + status : null, type || null, code !== undefined && code !== null && code !== status ? String(code) : null]
      .filter(Boolean).join(" · ");
    box.append(el("strong", "", "Error" + (head ? " — " + head : "")), el("div", "api-error-msg", message || "unknown error"));
    (target || messagesEl).append(box);
    scrollToBottom(true);
    return box;
  }

  async function errorFromResponse(resp) {
    let text = "";
    try { text = await resp.text(); } catch (_) { /* ignore */ }
    let message = text.slice(0, 1000) || resp.statusText || "request failed", type, code;
    try {
      const j = JSON.parse(text);
      const e = j && (j.error || j);
      if (typeof e === "string") message = e;
      else if (e) {
        message = e.message || (typeof e.detail === "string" ? e.detail : e.detail ? JSON.stringify(e.detail) : message);
        type = e.type;
        code = e.code;
      }
    } catch (_) { /* not JSON: keep the text */ }
    return { status: resp.status, type, code, message };
  }

  /** Yields the `data:` payload of each server-sent event as it arrives. */
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "", data = [];
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) {
          let line = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          if (line.endsWith("\r")) line = line.slice(0, -1);
          if (line === "") {
            if (data.length) { yield data.join("\n"); data = []; }
          } else if (line.startsWith("data:")) {
            data.push(line.slice(line[5] === " " ? 6 : 5));
          } // comments (":...") and other fields (event:, id:, retry:) are ignored
        }
      }
      buf += decoder.decode();
      if (buf.startsWith("data:")) data.push(buf.slice(buf[5] === " " ? 6 : 5));
      if (data.length) yield data.join("\n");
    } finally {
      reader.releaseLock();
    }
  }

  function setBusy(busy) {
    chat.busy = busy;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function settings() {
    const temperature = Number($("temperature").value);
    let maxTokens = parseInt($("max-tokens").value, 10);
    if (!Number.isFinite(maxTokens) || maxTokens < 1) maxTokens = 1;
    return { temperature, maxTokens, system: $("system-prompt").value.trim(), tools: $("tools").value.trim() };
  }

  /** Folds streamed `tool_calls` deltas into the calls so far: a call's first delta has its id and name, the
   *  following ones fragments of its arguments' JSON text. */
  function mergeToolCalls(calls, parts) {
    for (const part of parts || []) {
      const i = part.index || 0;
      if (!calls[i]) calls[i] = { id: part.id || "", type: "function", function: { name: "", arguments: "" } };
      const fn = part.function || {};
      if (part.id) calls[i].id = part.id;
      if (fn.name) calls[i].function.name += fn.name;
      if (fn.arguments) calls[i].function.arguments += fn.arguments;
    }
    return calls;
  }

  /** The reply's tool calls, one line each: name(arguments). */
  function showToolCalls(reply, calls) {
    let box = reply.wrap.querySelector(".tool-calls");
    if (!box) {
      box = el("div", "tool-calls");
      reply.bubble.after(box);
    }
    box.replaceChildren(...calls.filter(Boolean).map((c) => el("div", "tool-call", `${c.function.name}(${c.function.arguments})`)));
  }

  async function send(text) {
    if (chat.busy || !text.trim()) return;
    const { temperature, maxTokens, system, tools: toolsText } = settings();
    let tools = null;
    if (toolsText) {
      try { tools = JSON.parse(toolsText); } catch (e) {
        addError(null, { type: "invalid_request_error", code: "tools", message: "Tools: not valid JSON (" + e.message + ")" });
        return;
      }
    }
    const userTurn = { role: "user", content: text };
    chat.history.push(userTurn);
    const user = addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.wrap.classList.add("streaming");
    const meta = el("div", "meta", "waiting for the first token…");
    reply.wrap.append(meta);

    const messages = (system ? [{ role: "system", content: system }] : []).concat(chat.history);
    const body = { messages, stream: true, stream_options: { include_usage: true }, temperature, max_tokens: maxTokens };
    if (chat.model) body.model = chat.model;
    if (tools) body.tools = tools;

    const controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null, content = "", chunks = 0, finish = null, usage = null, streamError = null, stopped = false, failed = false;
    const calls = [];

    try {
      const resp = await fetch(api("/v1/chat/completions"), {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) {
        failed = true;
        addError(reply.wrap, await errorFromResponse(resp));
        return;
      }
      const ctype = resp.headers.get("content-type") || "";
      if (!ctype.includes("text/event-stream")) {
        // A server that ignored `stream`: take the whole answer at once.
        const j = await resp.json();
        const message = (j.choices && j.choices[0] && j.choices[0].message) || {};
        content = message.content || "";
        finish = j.choices && j.choices[0] && j.choices[0].finish_reason;
        usage = j.usage || null;
        tFirst = performance.now();
        reply.bubble.textContent = content;
        if (message.tool_calls) calls.push(...message.tool_calls);
        if (calls.length) showToolCalls(reply, calls);
        return;
      }
      for await (const data of sseData(resp.body)) {
        if (data === "[DONE]") break;
        let obj;
        try { obj = JSON.parse(data); } catch (_) { continue; }
        if (obj.error) { streamError = obj.error; continue; }
        if (obj.usage) usage = obj.usage;
        const choice = obj.choices && obj.choices[0];
        if (!choice) continue;
        const piece = choice.delta && typeof choice.delta.content === "string" ? choice.delta.content : "";
        if (piece) {
          if (tFirst === null) tFirst = performance.now();
          content += piece;
          chunks++;
          reply.bubble.textContent = content;
          meta.textContent = `${chunks} chunks · TTFT ${fmtSecs((tFirst - t0) / 1000)}`;
          scrollToBottom(false);
        }
        if (choice.delta && choice.delta.tool_calls) {
          if (tFirst === null) tFirst = performance.now();
          chunks++;
          showToolCalls(reply, mergeToolCalls(calls, choice.delta.tool_calls));
          scrollToBottom(false);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (e) {
      if (e && e.name === "AbortError") stopped = true;
      else {
        streamError = { message: "network error: " + (e && e.message ? e.message : e) + " — is the server reachable at " + (API_BASE || location.origin) + "?", type: "network_error" };
      }
    } finally {
      chat.controller = null;
      reply.wrap.classList.remove("streaming");
      const answered = content || calls.length;
      if (failed || (streamError && !answered)) {
        // Nothing came back: the turn is not part of the conversation; put the text back for a retry.
        chat.history.pop();
        user.wrap.classList.add("not-sent");
        user.wrap.querySelector(".who").textContent = "You · not sent";
        reply.bubble.remove();
        if (!promptEl.value) { promptEl.value = text; autosize(); }
      } else if (answered || !stopped) {
        chat.history.push(calls.length ? { role: "assistant", content: content || null, tool_calls: calls.filter(Boolean) }
                                       : { role: "assistant", content });
      } else {
        chat.history.pop(); // stopped before any token: drop the unanswered turn
        user.wrap.classList.add("not-sent");
      }
      if (streamError) addError(reply.wrap, { type: streamError.type, code: streamError.code, message: streamError.message });
      if (failed || (streamError && !answered)) {
        meta.remove();
      } else {
        const tEnd = performance.now();
        const tokens = usage && isNum(usage.completion_tokens) ? usage.completion_tokens : chunks;
        const parts = [];
        parts.push(`${tokens} ${usage ? "tokens" : "chunks"}`);
        if (tFirst !== null) parts.push(`TTFT ${fmtSecs((tFirst - t0) / 1000)}`);
        if (tFirst !== null && tEnd - tFirst > 1 && tokens > 1) parts.push(fmtRate((tokens - 1) / ((tEnd - tFirst) / 1000)));
        parts.push(stopped ? "stopped" : "finish: " + (finish || (streamError ? "error" : "unknown")));
        meta.textContent = parts.join(" · ");
        meta.dataset.finish = stopped ? "stopped" : finish || "";
        reply.wrap.dataset.finish = stopped ? "stopped" : finish || "error";
      }
      setBusy(false);
      scrollToBottom(false);
      promptEl.focus();
    }
  }

  function stop() {
    if (chat.controller) chat.controller.abort();
  }

  function newChat() {
    stop();
    chat.history = [];
    for (const m of [...messagesEl.querySelectorAll(".msg, .api-error")]) m.remove();
    $("empty-hint").hidden = false;
    promptEl.focus();
  }

  function autosize() {
    promptEl.style.height = "auto";
    promptEl.style.height = Math.min(promptEl.scrollHeight, 200) + "px";
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = promptEl.value;
    if (!text.trim() || chat.busy) return;
    promptEl.value = "";
    autosize();
    send(text);
  });
  promptEl.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.altKey && !e.metaKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    } else if (e.key === "Escape" && chat.busy) {
      e.preventDefault();
      stop();
    }
  });
  promptEl.addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && chat.busy) stop(); });

  // Settings (kept in localStorage)
  const temp = $("temperature"), tempOut = $("temperature-out"), maxTok = $("max-tokens"), sysPrompt = $("system-prompt");
  const stored = (k) => localStorage.getItem("rustinfer." + k);
  if (stored("temperature") !== null) temp.value = stored("temperature");
  if (stored("max_tokens") !== null) maxTok.value = stored("max_tokens");
  if (stored("system") !== null) sysPrompt.value = stored("system");
  const showTemp = () => { tempOut.textContent = Number(temp.value).toFixed(2); };
  showTemp();
  temp.addEventListener("input", () => { showTemp(); localStorage.setItem("rustinfer.temperature", temp.value); });
  maxTok.addEventListener("change", () => localStorage.setItem("rustinfer.max_tokens", maxTok.value));
  sysPrompt.addEventListener("change", () => localStorage.setItem("rustinfer.system", sysPrompt.value));

  // API key: a new one reloads the model list (which a keyed server refused without it)
  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem(KEY_STORE) || "";
  keyInput.addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, keyInput.value.trim());
    loadModels();
  });

  // Model list
  const modelSel = $("model");
  modelSel.addEventListener("change", () => {
    chat.model = modelSel.value;
    localStorage.setItem("rustinfer.model", chat.model);
  });
  let modelsRetry = null;
  async function loadModels() {
    clearTimeout(modelsRetry); // one retry chain, however often the key changes
    try {
      const r = await fetchWithTimeout(api("/v1/models"), 5000);
      if (!r.ok) throw new Error((await errorFromResponse(r)).message + " (HTTP " + r.status + ")");
      const j = await r.json();
      const ids = (j.data || []).map((m) => m.id).filter(Boolean);
      if (!ids.length) throw new Error("the server lists no models");
      modelSel.replaceChildren(...ids.map((id) => { const o = el("option", "", id); o.value = id; return o; }));
      const want = stored("model");
      modelSel.value = ids.includes(want) ? want : ids[0];
      chat.model = modelSel.value;
      modelSel.title = "Model (from /v1/models)";
      if ($("sys-model").textContent === NA) setText("sys-model", chat.model);
    } catch (e) {
      const o = el("option", "", "no model — retrying");
      o.value = "";
      modelSel.replaceChildren(o);
      modelSel.title = "GET /v1/models failed: " + (e.message || e);
      chat.model = "";
      modelsRetry = setTimeout(loadModels, 5000);
    }
  }

  // Live window
  const winSel = $("window");
  winSel.value = String(live.windowS);
  if (winSel.value !== String(live.windowS)) { live.windowS = 300; winSel.value = "300"; }
  winSel.addEventListener("change", () => {
    live.windowS = Number(winSel.value);
    localStorage.setItem("rustinfer.window", winSel.value);
    renderLive();
  });

  // Narrow screens: Chat / Live tabs
  const main = document.querySelector("main.layout");
  for (const b of document.querySelectorAll(".tabs button")) {
    b.addEventListener("click", () => {
      main.dataset.view = b.dataset.view;
      for (const o of document.querySelectorAll(".tabs button")) o.setAttribute("aria-selected", String(o === b));
    });
  }

  // Exposed for tests and debugging.
  window.rustinfer = { parsePrometheus, reading, histogramQuantile, samples, chat, apiBase: API_BASE };

  loadModels();
  liveTick();
  promptEl.focus();
})();
