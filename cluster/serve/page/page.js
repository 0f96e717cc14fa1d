// serve's page: polls /v1/cluster and draws it; a chat box that streams from
// /v1/chat/completions. Plain JavaScript, no library: a rig may have no internet.
"use strict";

const KEY = "mlx-cluster-key";  // the API key lives in this tab's session only
const POLL_MS = 2000;
const CHAT_MAX_TOKENS = 512;
const PHASE_COLORS = { ready: "#1f8a4c", generating: "#1f8a4c", loading: "#b26a00",
  init: "#b26a00", starting: "#b26a00", links: "#b26a00" };
const $ = (id) => document.getElementById(id);
let model = null;
const history = [];

$("key").value = sessionStorage.getItem(KEY) || "";
$("key").addEventListener("change", () => { sessionStorage.setItem(KEY, $("key").value); poll(); });

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("key").value;
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function problem(text) {
  $("problem").hidden = !text;
  $("problem").textContent = text || "";
}

function svg(tag, attrs, text) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function gb(x) {
  if (x === null || x === undefined) return "–";
  return x < 1 ? (x * 1000).toFixed(0) + " MB" : x.toFixed(2) + " GB";
}
function secs(x) { return x === null || x === undefined ? "–" : x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s"; }

function us(x) { return x < 1000 ? x.toFixed(0) + " µs" : (x / 1000).toFixed(1) + " ms"; }
function gbit(x) { return x.toFixed(x < 10 ? 2 : 1) + " Gbit/s"; }

function linkBetween(c, one, other) {  // the measured link joining two hosts, if any
  const all = c.links ? c.links.links : [];
  return all.find((l) => (l.hosts[0] === one && l.hosts[1] === other) ||
                         (l.hosts[0] === other && l.hosts[1] === one));
}

function holds(r, c, host) {  // a pipeline rank's layers are known once it has loaded
  const group = c.groups && host.group !== undefined ? c.groups[host.group] : c;  // a fleet's
  if (group.mode === "tensor") return "a share of every layer";
  if (r.layers) return `layers ${r.layers[0]}–${r.layers[1] - 1}`;
  return group.ranks > 1 ? "–" : "all layers";
}

function drawRig(c) {
  const area = $("rig");
  area.replaceChildren();
  const n = c.hosts.length, w = 190, h = 120, gap = 100, top = 30;
  const width = n * w + (n - 1) * gap + 20;
  area.setAttribute("viewBox", `0 0 ${Math.max(width, 400)} 190`);
  area.setAttribute("preserveAspectRatio", "xMinYMid meet");
  c.hosts.forEach((host, i) => {
    const x = 10 + i * (w + gap);
    const apart = i > 0 && host.group !== c.hosts[i - 1].group;  // a fleet: another group
    if (i > 0 && !apart) {  // the link to the host before, in the ring's order, with its figures
      const up = !host.left_out && !c.hosts[i - 1].left_out;
      const link = up ? linkBetween(c, c.hosts[i - 1].name, host.name) : null;
      const color = link && link.slow ? "#c62828" : up ? "#6e6e73" : "#d2d2d7";
      area.append(svg("line", { x1: x - gap, y1: top + h / 2, x2: x, y2: top + h / 2,
        stroke: color, "stroke-width": link && link.slow ? 5 : 3,
        "stroke-dasharray": up ? "" : "6 4" }));
      if (link) {
        const mid = x - gap / 2, fill = link.slow ? "#c62828" : "#6e6e73";
        area.append(svg("text", { x: mid, y: top + h / 2 - 8, "font-size": 11, fill,
          "text-anchor": "middle" }, us(link.rtt_us)));
        area.append(svg("text", { x: mid, y: top + h / 2 + 18, "font-size": 11, fill,
          "text-anchor": "middle" }, gbit(link.gbps)));
      }
    }
    area.append(svg("rect", { x, y: top, width: w, height: h, rx: 12,
      fill: host.left_out ? "#f1f1f3" : "#fff", stroke: host.left_out ? "#c62828" : "#d2d2d7",
      "stroke-width": 2, "stroke-dasharray": host.left_out ? "6 4" : "" }));
    area.append(svg("text", { x: x + 10, y: top + 20, "font-weight": 600, "font-size": 14 },
      hostName(host)));
    area.append(svg("text", { x: x + 10, y: top + 38, fill: "#6e6e73", "font-size": 12 },
      host.left_out ? "left out" : host.address + (host.memory_gb ? ` · ${host.memory_gb} GB` : "")));
    host.ranks.forEach((r, j) => {
      const rx = x + 10 + j * 58;
      const color = PHASE_COLORS[r.phase] || "#c62828";
      area.append(svg("rect", { x: rx, y: top + 50, width: 52, height: 34, rx: 6, fill: color }));
      area.append(svg("text", { x: rx + 26, y: top + 72, fill: "#fff", "font-size": 13,
        "text-anchor": "middle", "font-weight": 600 }, `rank ${r.rank}`));
    });
    const used = host.ranks.reduce((s, r) => s + (r.peak_memory_gb || 0), 0);
    if (host.memory_gb) {  // peak memory against the host's 85% limit
      const limit = 0.85 * host.memory_gb, frac = Math.min(used / limit, 1);
      area.append(svg("rect", { x: x + 10, y: top + 94, width: w - 20, height: 8, rx: 4, fill: "#e5e5ea" }));
      area.append(svg("rect", { x: x + 10, y: top + 94, width: (w - 20) * frac, height: 8, rx: 4,
        fill: frac > 0.9 ? "#c62828" : "#0a84ff" }));
      area.append(svg("text", { x: x + 10, y: top + 116, "font-size": 11, fill: "#6e6e73" },
        `${gb(used)} of ${gb(limit)}`));
    } else if (!host.left_out) {
      area.append(svg("text", { x: x + 10, y: top + 104, "font-size": 11, fill: "#6e6e73" },
        `peak ${gb(used)}`));
    }
  });
}

function hostName(host) {  // a fleet's hosts say their group
  return host.group === undefined ? host.name : `group ${host.group} · ${host.name}`;
}

function drawRanks(c) {
  const rows = [];
  for (const host of c.hosts) {
    for (const r of host.ranks) {
      const tr = document.createElement("tr");
      for (const cell of [r.rank, hostName(host), r.phase, secs(r.heartbeat_age_s),
                          gb(r.peak_memory_gb), holds(r, c, host)]) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.append(td);
      }
      tr.dataset.rank = r.rank;
      tr.dataset.phase = r.phase;
      rows.push(tr);
    }
  }
  $("ranks").tBodies[0].replaceChildren(...rows);
}

function drawLinks(c) {
  const rows = (c.links ? c.links.links : []).map((l) => {
    const tr = document.createElement("tr");
    for (const cell of [`${l.a}–${l.b}`, `${l.hosts[0]} – ${l.hosts[1]}`, us(l.rtt_us),
                        us(l.worst_rtt_us), gbit(l.gbps), l.exact ? "yes" : "NO"]) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.append(td);
    }
    if (l.slow) tr.className = "slow";
    tr.dataset.link = `${l.a}-${l.b}`;
    return tr;
  });
  $("links").tBodies[0].replaceChildren(...rows);
  const m = c.links;
  $("allsum").textContent = !m
    ? (c.ranks > 1 ? "measured as the ranks start (--measure-links)" : "one rank: no links")
    : `all_sum over ${c.ranks} ranks: ${us(m.allsum_4b_us)} at 4 B, ${us(m.allsum_8kb_us)} ` +
      `at 8 KB${m.allsum_exact ? "" : " — NOT exact"} · measured ` +
      new Date(m.measured_at * 1000).toLocaleTimeString();
  $("linkproblems").replaceChildren(...(m ? m.problems : []).map((p) => {
    const li = document.createElement("li");
    li.textContent = p;
    return li;
  }));
}

function drawChart(c) {
  const canvas = $("chart"), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 24;
  ctx.clearRect(0, 0, W, H);
  const most = Math.max(1, ...c.rates.map((b) => Math.max(b.prefill_tps, b.decode_tps)));
  ctx.fillStyle = "#6e6e73";
  ctx.font = "11px sans-serif";
  ctx.fillText(`${most.toFixed(0)} tok/s`, 2, 12);
  const step = (W - pad) / c.rates.length;
  for (const [key, color, off] of [["prefill_tps", "#7a5af8", 0], ["decode_tps", "#0a84ff", 0.5]]) {
    ctx.fillStyle = color;
    c.rates.forEach((b, i) => {
      const hgt = (H - pad) * (b[key] / most);
      ctx.fillRect(pad + i * step + off * step * 0.9, H - 4 - hgt, step * 0.45, hgt);
    });
  }
}

function drawLists(c) {
  const pre = c.prefilling.map((p) => {
    const li = document.createElement("li");
    li.textContent = `prefilling ${p.id.slice(0, 8)}: ${p.done} of ${p.total} tokens (${Math.floor(100 * p.done / p.total)}%)`;
    return li;
  });
  $("prefilling").replaceChildren(...pre);
  const fails = c.failures.map((f) => {
    const li = document.createElement("li");
    const back = f.back_after_s === null ? "not back yet" : `back after ${f.back_after_s.toFixed(1)} s`;
    li.textContent = `${new Date(f.at * 1000).toLocaleTimeString()}: ${f.message} (${back})`;
    return li;
  });
  const left = c.hosts.filter((h) => h.left_out).map((h) => {
    const li = document.createElement("li");
    li.textContent = `${h.name} is left out`;
    return li;
  });
  const items = [...fails, ...left];
  if (!items.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "none";
    items.push(li);
  }
  $("failures").replaceChildren(...items);
}

function drawHandoffs(h) {  // prompts a prefill group prefilled for a decode group
  $("handoffs").hidden = !h || !h.count;
  if (!h || !h.count) return;
  const mb = h.bytes / 1e6;
  const rate = h.p50_s ? ` (about ${(mb / h.count / h.p50_s).toFixed(1)} MB/s)` : "";
  $("handoffs").textContent = `${h.count} prompt(s) prefilled by a prefill group, last 5 minutes: ` +
    `${mb.toFixed(1)} MB of KV cache handed over, median ${secs(h.p50_s)} each${rate}`;
}

function draw(c) {
  model = c.model;
  $("model").textContent = `${c.model} · ${c.mode} mode`;
  $("status").textContent = c.status;
  $("status").className = "badge " + c.status;
  const groups = c.groups ? `${c.groups_ready} of ${c.groups.length} groups serving · ` : "";
  $("summary").textContent =
    `${groups}${c.ranks_up} of ${c.ranks} ranks up · ${c.restarts} restart(s)`;
  $("running").textContent = c.in_flight;
  $("waiting").textContent = c.waiting;
  $("ttft50").textContent = secs(c.ttft_s.p50);
  $("ttft95").textContent = secs(c.ttft_s.p95);
  drawHandoffs(c.handoffs);
  drawRig(c);
  drawRanks(c);
  drawLinks(c);
  drawChart(c);
  drawLists(c);
}

async function poll() {
  try {
    const r = await fetch("/v1/cluster", { headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      problem("This server needs its API key: type it above.");
      return;
    }
    if (!r.ok) throw new Error(`/v1/cluster: HTTP ${r.status}`);
    problem("");
    draw(await r.json());
  } catch (e) {
    problem(`The server does not answer (${e.message}); retrying.`);
    $("status").textContent = "down";
    $("status").className = "badge down";
  }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function ask(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  $("send").disabled = true;
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      // greedy, so that the box shows the model's own likeliest answer, the same each time
      body: JSON.stringify({ model: model, messages: history, stream: true, temperature: 0,
        max_tokens: CHAT_MAX_TOKENS }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data: {")) continue;  // comments (keep-alive), [DONE]
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          answer += delta.content;
          out.textContent = answer;
        }
      }
    }
    out.dataset.done = "1";
    history.push({ role: "assistant", content: answer });
  } catch (e) {
    out.className = "msg error";
    out.textContent = `The answer failed: ${e.message}`;
    out.dataset.done = "1";
    history.pop();
  } finally {
    $("send").disabled = false;
  }
}

$("ask").addEventListener("submit", ask);
poll();
setInterval(poll, POLL_MS);
