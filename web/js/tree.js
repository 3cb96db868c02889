// The hierarchy drawn as a picture (the paper's Fig. 1): this host's layers as a tree (root at the top, each
// layer below the one it builds on), each version hanging from the layer its disk ends in, and a running
// instance below its version. The data is GET /api/tree (the graph `capsule tree --json` prints); the
// layout is a plain tidy tree: every leaf gets a column, a parent sits over the middle of its children.
//
//   renderTree(graph)   draw (again) into #tree-view; the selection survives a redraw
//   selectVersion(ref)  highlight that version's chains (the layers it reads, root to top); null clears
//
// Every box is <g class="node" data-node="layer:ID|version:NAME@V|instance:NAME@V">, every line is
// <path class="edge" data-from=… data-to=… data-kind="parent|top|runs">, so a test (or a script reading the
// page) finds them by what they are.

import { bytes, h } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const BOX = { w: 156, h: 44 };
const COL = 176;     // one leaf's column
const ROW = 84;      // one level
const PAD = 16;

let graph = null;
let drawn = "";      // the graph last drawn (JSON), to redraw only when it changed
let selected = null; // a version's ref

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const short = (id) => id.slice(0, 10);
const fit = (text, n = 24) => (text.length > n ? `${text.slice(0, n - 1)}…` : text);

// The nodes and who is under whom: layers under their parent layer, versions under the top layer of their
// first disk, instances under their version. A version whose layer is not in the graph is a root of its own.
function nodes(g) {
  const all = new Map();
  const kids = new Map([[null, []]]);
  const add = (n, parent) => {
    all.set(n.key, n);
    kids.set(n.key, []);
    kids.get(all.has(parent) ? parent : null).push(n.key);
  };
  for (const l of g.layers) add({ key: `layer:${l.id}`, kind: "layer", data: l }, l.parent && `layer:${l.parent}`);
  for (const v of g.versions) add({ key: `version:${v.ref}`, kind: "version", data: v }, v.tops[0] && `layer:${v.tops[0]}`);
  for (const i of g.instances) add({ key: `instance:${i.ref}`, kind: "instance", data: i }, `version:${i.ref}`);
  return { all, kids };
}

// x (column centre, in columns) and level of every node
function layout({ all, kids }) {
  const pos = new Map();
  let next = 0;
  const place = (key, level) => {
    const children = kids.get(key);
    if (children.length === 0) {
      pos.set(key, { x: next + 0.5, level });
      next += 1;
      return;
    }
    for (const c of children) place(c, level + 1);
    const xs = children.map((c) => pos.get(c).x);
    pos.set(key, { x: (Math.min(...xs) + Math.max(...xs)) / 2, level });
  };
  for (const root of kids.get(null)) place(root, 0);
  const levels = Math.max(0, ...[...pos.values()].map((p) => p.level)) + 1;
  return { pos, columns: Math.max(next, 1), levels, all };
}

const at = (p) => ({ x: PAD + p.x * COL, y: PAD + p.level * ROW });

function label(n, g) {
  if (n.kind === "layer") {
    const l = n.data;
    const title = l.images.length ? `${short(l.id)} · image ${l.images.join(", ")}` : short(l.id);
    const detail = l.remote ? `at ${l.remote.url}` : bytes(l.stored_bytes);
    return [title, detail];
  }
  if (n.kind === "version") {
    const v = n.data;
    const mem = v.memory && g.memory_images.find((m) => m.id === v.memory);
    return [v.ref, v.active ? `memory ${mem ? bytes(mem.allocated) : ""}` : "disk only"];
  }
  return ["running", n.data.domain];
}

function box(n, p, g) {
  const { x, y } = at(p);
  const [title, detail] = label(n, g);
  const attrs = { class: `node ${n.kind}`, "data-node": n.key, transform: `translate(${x - BOX.w / 2},${y})` };
  if (n.kind === "version") {
    attrs["data-running"] = n.data.running ? "yes" : "no";
    attrs["data-active"] = n.data.active ? "yes" : "no";
    attrs.tabindex = 0;
    attrs.role = "button";
    attrs.onclick = (ev) => { ev.stopPropagation(); selectVersion(selected === n.data.ref ? null : n.data.ref); };
    attrs.onkeydown = (ev) => {
      if (ev.key !== "Enter" && ev.key !== " ") return;
      ev.preventDefault();
      attrs.onclick(ev);
    };
  }
  if (n.kind === "layer" && n.data.remote) attrs["data-remote"] = "yes";
  const tip = n.kind === "layer" ? [n.data.id, ...n.data.images.map((i) => `image ${i}`)].join("\n") : n.kind === "version" ? `${n.data.ref}: click to show its chain`
    : `${n.data.ref} runs as ${n.data.domain}`;
  return s("g", attrs,
    s("title", {}, tip),
    s("rect", { width: BOX.w, height: BOX.h, rx: n.kind === "layer" ? 4 : 12 }),
    s("text", { x: BOX.w / 2, y: 18, class: "title" }, fit(title)),
    s("text", { x: BOX.w / 2, y: 35, class: "detail" }, fit(detail, 27)));
}

function edge(from, to, kind, pos, extra = {}) {
  const a = at(pos.get(from));
  const b = at(pos.get(to));
  const y1 = a.y + BOX.h;
  const mid = (y1 + b.y) / 2;
  return s("path", { class: `edge ${kind}`, "data-from": from, "data-to": to, "data-kind": kind, ...extra,
    d: `M${a.x},${y1} C${a.x},${mid} ${b.x},${mid} ${b.x},${b.y}` });
}

export function renderTree(g) {
  const text = JSON.stringify(g);
  if (text === drawn) return;
  drawn = text;
  graph = g;
  const root = document.getElementById("tree-view");
  if (!g.layers.length && !g.versions.length) {
    root.replaceChildren(h("p", { class: "empty" }, "no layers yet: build or import an image"));
    return;
  }
  const tree = nodes(g);
  const { pos, columns, levels, all } = layout(tree);
  const edges = [];
  for (const l of g.layers) {
    if (l.parent && pos.has(`layer:${l.parent}`)) edges.push(edge(`layer:${l.parent}`, `layer:${l.id}`, "parent", pos));
  }
  for (const v of g.versions) {
    v.tops.forEach((top, disk) => {
      if (top && pos.has(`layer:${top}`)) edges.push(edge(`layer:${top}`, `version:${v.ref}`, "top", pos, { "data-disk": disk }));
    });
  }
  for (const i of g.instances) {
    if (pos.has(`version:${i.ref}`)) edges.push(edge(`version:${i.ref}`, `instance:${i.ref}`, "runs", pos));
  }
  const width = columns * COL + 2 * PAD;
  const height = levels * ROW - (ROW - BOX.h) + 2 * PAD;
  const svg = s("svg", { xmlns: SVG, width, height, viewBox: `0 0 ${width} ${height}`, role: "group",
    "aria-label": `hierarchy of store ${g.store_id}`, "data-store": g.store_id,
    onclick: () => selectVersion(null) },
  s("g", { class: "edges" }, edges),
  s("g", { class: "nodes" }, [...all.values()].map((n) => box(n, pos.get(n.key), g))));
  root.replaceChildren(svg);
  if (selected && !g.versions.some((v) => v.ref === selected)) selected = null;
  selectVersion(selected);
}

// Highlight a version and its chains: every layer it reads and the lines between them.
export function selectVersion(ref) {
  selected = ref;
  const svg = document.querySelector("#tree-view svg");
  const info = document.getElementById("tree-selection");
  const v = ref && graph && graph.versions.find((x) => x.ref === ref);
  const on = new Set();
  if (v) {
    on.add(`version:${v.ref}`);
    if (v.running) on.add(`instance:${v.ref}`);
    for (const chain of v.chains) for (const lid of chain) on.add(`layer:${lid}`);
  }
  if (svg) {
    svg.dataset.selected = v ? v.ref : "";
    for (const el of svg.querySelectorAll("[data-node]")) {
      el.dataset.selected = on.has(el.dataset.node) ? "yes" : "no";
      if (el.getAttribute("role") === "button") el.setAttribute("aria-pressed", String(el.dataset.node === `version:${ref}`));
    }
    for (const el of svg.querySelectorAll("[data-from]")) {
      const yes = on.has(el.dataset.from) && on.has(el.dataset.to)
        && (el.dataset.kind !== "top" || el.dataset.to === `version:${ref}`);
      el.dataset.selected = yes ? "yes" : "no";
    }
  }
  if (!info) return;
  if (!v) {
    info.textContent = "Click a version to see the layers it reads.";
    return;
  }
  const from = !v.parent ? "" : v.parent.startsWith(`${v.capsule}@`) ? ` (after ${v.parent})` : ` (derived from ${v.parent})`;
  info.replaceChildren(h("strong", {}, v.ref), from, ": ",
    ...v.chains.map((chain, disk) => h("span", { class: "chain", "data-disk": disk },
      `disk ${disk}: ${chain.map(short).join(" → ")}`)),
    v.running ? " · running" : "", v.active ? " · with memory" : " · disk only");
}
