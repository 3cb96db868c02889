// The live console: a running capsule's screen (noVNC's RFB) or its serial console (xterm.js), through its
// agent's WebSockets. Each connection asks the agent for a ticket first (a CSRF-checked POST): a ticket opens
// that one capsule's console of that kind once, within 30 s, for this session. Nothing here talks to the
// guest but the agent's WebSocket.
//
//   openConsole(host, name, { kind })   show the panel and connect. host: null/"" = this host; otherwise a peer
//                                       of this host, by its name (as in /api/hosts) or its URL: its console is
//                                       relayed through this agent (/api/hosts/HOST/console/NAME), so the page
//                                       needs no sign-in there. kind: "screen" (default) or "serial".
//   closeConsole()                      disconnect and hide the panel.
//   consoleMoving(name, to)             a move of that capsule began (the migrate dialog): a lost connection
//                                       says it is moving rather than lost
// Calling openConsole again (e.g. when a migrated capsule comes up on its new host) replaces the connection.
// #console carries data-capsule, data-host (as given) and data-peer (the peer's name; "" for this host), and
// #console-state data-state (connecting, connected, disconnected, failed), for scripts and tests.

import RFB from "/web/vendor/novnc/core/rfb.js";
import { Terminal } from "/web/vendor/xterm/lib/xterm.mjs";
import * as api from "./api.js";
import { clipboardFor } from "./clipboard.js";
import { fitScreen } from "./fit.js";

const $ = (id) => document.getElementById(id);

const current = { rfb: null, ws: null, term: null, host: null, name: null, kind: "screen", generation: 0,
  moving: null, unfit: null };

function setState(state, text) {
  const el = $("console-state");
  el.dataset.state = state;
  el.textContent = text;
  $("console-reconnect").hidden = state === "connected" || state === "connecting";
}

function wsUrl(path) {
  const base = new URL(window.location.origin);
  base.protocol = base.protocol === "https:" ? "wss:" : "ws:";
  return new URL(path, base).href;
}

// a peer given by its URL: its name among this host's peers
async function peerName(host) {
  if (!host.includes("://")) return host;
  const want = host.replace(/\/+$/, "");
  const peer = (await api.peers()).find((p) => p.url.replace(/\/+$/, "") === want);
  if (!peer) throw new Error(`${host} is not one of this host's peers (capsule host add)`);
  return peer.name;
}

function disconnect() {
  current.generation += 1;
  const { rfb, ws, term, unfit } = current;
  current.rfb = current.ws = current.term = current.unfit = null;
  if (unfit) unfit();
  try {
    if (rfb) rfb.disconnect();
    if (ws) ws.close();
    if (term) term.dispose();
  } catch {
    // already gone
  }
  $("console-screen").replaceChildren();
  $("console-serial").replaceChildren();
}

function showKind(kind) {
  clipboardFor(current.host, current.name, kind);
  $("console-fullscreen").hidden = kind !== "screen" || !document.fullscreenEnabled;
  $("console-screen").hidden = kind !== "screen";
  $("console-serial").hidden = kind !== "serial";
  for (const b of document.querySelectorAll("#console [data-kind]")) {
    b.setAttribute("aria-pressed", String(b.dataset.kind === kind));
  }
}

async function connect() {
  disconnect();
  const generation = current.generation;
  const { host, name, kind } = current;
  const live = () => generation === current.generation;
  showKind(kind);
  setState("connecting", "asking for a ticket…");
  let grant;
  let peer = null;
  try {
    peer = host ? await peerName(host) : null;
    if (live()) {
      $("console").dataset.peer = peer || "";
      if (peer) $("console-title").textContent = `${name} on ${peer}`;   // a URL given: its peer's name
      clipboardFor(peer, name, kind);       // a peer's capsule's clipboard: through this agent
    }
    grant = peer ? await api.peerConsoleTicket(peer, name, kind) : await api.consoleTicket(name, kind);
  } catch (err) {
    if (live()) setState("failed", `no console: ${err.message}`);
    return;
  }
  if (!live()) return;   // closed or reopened meanwhile
  setState("connecting", "connecting…");
  const url = wsUrl(grant.url);
  const lost = (clean) => {
    if (!live()) return;
    if (current.moving) setState("disconnected", `moving to ${current.moving}: the console follows it there…`);
    else setState("disconnected", clean ? "disconnected" : "connection lost (the capsule stopped or moved?)");
  };
  if (kind === "serial") connectSerial(url, live, lost);
  else connectScreen(url, live, lost, peer);
}

function connectScreen(url, live, lost, peer) {
  const rfb = new RFB($("console-screen"), url, { wsProtocols: ["binary"] });
  // Resize: the guest's resolution follows the panel through its guest agent (fit.js), and what the guest shows
  // is scaled to fit (always: a guest that cannot change its resolution, such as a text console, still fits).
  // Not noVNC's resizeSession (the VNC SetDesktopSize message): the capsule's display is QEMU's standard VGA
  // card, and QEMU 10.0's VNC server answers a SetDesktopSize for it with status 3, "invalid screen layout"
  // (measured; it forwards the request only for a display with a resize path, such as virtio-vga: status 4).
  rfb.scaleViewport = true;
  rfb.resizeSession = false;
  rfb.focusOnClick = true;
  rfb.addEventListener("connect", () => {
    if (!live()) return;
    setState("connected", "connected");
    rfb.focus({ preventScroll: true });   // keys go to the guest at once, as on the serial console
    current.unfit = fitScreen(peer, current.name, $("console-screen"));     // a peer's: through this agent
  });
  rfb.addEventListener("disconnect", (ev) => {
    if (live()) {
      current.rfb = null;
      if (current.unfit) current.unfit();     // the screen is gone: its size is not followed any more
      current.unfit = null;
    }
    lost(ev.detail.clean);
  });
  rfb.addEventListener("securityfailure", (ev) => {
    if (live()) setState("failed", `refused: ${ev.detail.reason || "security failure"}`);
  });
  current.rfb = rfb;
}

function connectSerial(url, live, lost) {
  const term = new Terminal({ cols: 100, rows: 30, convertEol: false, scrollback: 2000,
    fontFamily: "ui-monospace, monospace", fontSize: 14 });
  term.open($("console-serial"));
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => {
    if (!live()) return;
    setState("connected", "connected");
    term.focus();
  };
  ws.onmessage = (ev) => term.write(new Uint8Array(ev.data));
  ws.onclose = (ev) => lost(ev.wasClean);
  term.onData((data) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(data);
  });
  current.ws = ws;
  current.term = term;
}

export function openConsole(host, name, { kind = "screen" } = {}) {
  current.moving = null;
  current.host = host || null;
  current.name = name;
  current.kind = kind;
  $("console-title").textContent = host ? `${name} on ${host}` : name;
  $("console").hidden = false;
  $("console").dataset.capsule = name;
  $("console").dataset.host = host || "";   // as given: "" (this host), a peer's name or its URL
  delete $("console").dataset.peer;         // the peer's name, once known ("" for this host)
  return connect();
}

export function closeConsole() {
  disconnect();
  current.name = null;
  clipboardFor(null, null, null);
  $("console").hidden = true;
  delete $("console").dataset.capsule;
  delete $("console").dataset.host;
  delete $("console").dataset.peer;
}

export const consoleCapsule = () => current.name;

// The migrate dialog says a move of `name` to host `to` has begun: when the connection drops, the panel says
// so instead of "connection lost" (openConsole, when the capsule arrives or comes back, clears it).
export function consoleMoving(name, to) {
  if (current.name === name) current.moving = to;
}

$("console-reconnect").addEventListener("click", () => {
  if (current.name) connect();
});
$("console-close").addEventListener("click", closeConsole);
// the screen alone on the whole display, scaled to fit it (Esc leaves)
$("console-fullscreen").addEventListener("click", () => {
  $("console-screen").requestFullscreen().catch(() => {});
});
for (const b of document.querySelectorAll("#console [data-kind]")) {
  b.addEventListener("click", () => {
    if (current.name && current.kind !== b.dataset.kind) {
      current.kind = b.dataset.kind;
      connect();
    }
  });
}
