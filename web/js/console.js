// The live console: a running capsule's screen, through its agent (noVNC's RFB over the agent's WebSocket).
// Each connection asks the agent for a ticket first (a CSRF-checked POST): a ticket opens that one capsule's
// screen once, within 30 s, for this session. Nothing here talks to the guest but the agent's WebSocket.
//
//   openConsole(hostUrl, name, { ticket })   show the panel and connect; hostUrl null/"" = this host.
//                                            `ticket` (optional): async () => ({url}) for a host whose ticket
//                                            this page cannot ask for itself (default: this host's API).
//   closeConsole()                           disconnect and hide the panel.
// Calling openConsole again (e.g. when a migrated capsule comes up on its new host) replaces the connection.

import RFB from "/web/vendor/novnc/core/rfb.js";
import * as api from "./api.js";

const $ = (id) => document.getElementById(id);

const current = { rfb: null, hostUrl: null, name: null, ticket: null, generation: 0 };

function setState(state, text) {
  const el = $("console-state");
  el.dataset.state = state;
  el.textContent = text;
  $("console-reconnect").hidden = state === "connected" || state === "connecting";
}

function wsUrl(hostUrl, path) {
  const base = new URL(hostUrl || window.location.origin);
  base.protocol = base.protocol === "https:" ? "wss:" : "ws:";
  return new URL(path, base).href;
}

function disconnect() {
  current.generation += 1;
  if (current.rfb) {
    const rfb = current.rfb;
    current.rfb = null;
    try {
      rfb.disconnect();
    } catch {
      // already gone
    }
  }
  $("console-screen").replaceChildren();
}

async function connect() {
  disconnect();
  const generation = current.generation;
  const { hostUrl, name } = current;
  setState("connecting", "asking for a ticket…");
  let grant;
  try {
    grant = current.ticket ? await current.ticket() : await api.consoleTicket(name);
  } catch (err) {
    if (generation === current.generation) setState("failed", `no console: ${err.message}`);
    return;
  }
  if (generation !== current.generation) return;   // closed or reopened meanwhile
  setState("connecting", "connecting…");
  const rfb = new RFB($("console-screen"), wsUrl(hostUrl, grant.url), { wsProtocols: ["binary"] });
  rfb.scaleViewport = true;     // the whole screen, scaled to fit the panel
  rfb.resizeSession = false;
  rfb.focusOnClick = true;
  rfb.addEventListener("connect", () => {
    if (generation === current.generation) setState("connected", "connected");
  });
  rfb.addEventListener("disconnect", (ev) => {
    if (generation !== current.generation) return;
    current.rfb = null;
    setState("disconnected", ev.detail.clean ? "disconnected" : "connection lost (the capsule stopped or moved?)");
  });
  rfb.addEventListener("securityfailure", (ev) => {
    if (generation === current.generation) setState("failed", `refused: ${ev.detail.reason || "security failure"}`);
  });
  current.rfb = rfb;
}

export function openConsole(hostUrl, name, { ticket = null } = {}) {
  current.hostUrl = hostUrl || null;
  current.name = name;
  current.ticket = ticket;
  $("console-title").textContent = hostUrl ? `${name} on ${hostUrl}` : name;
  $("console").hidden = false;
  $("console").dataset.capsule = name;
  return connect();
}

export function closeConsole() {
  disconnect();
  current.name = null;
  $("console").hidden = true;
  delete $("console").dataset.capsule;
}

export const consoleCapsule = () => current.name;

$("console-reconnect").addEventListener("click", () => {
  if (current.name) connect();
});
$("console-close").addEventListener("click", closeConsole);
