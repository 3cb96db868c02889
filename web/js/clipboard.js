// The console bar's clipboard box: the guest's clipboard both ways, through its agent's guest agent
// (GET/PUT /api/capsules/NAME/clipboard; a peer's capsule's, such as one the console followed there, through this
// agent: /api/hosts/HOST/capsules/NAME/clipboard). Copy in the browser, paste into the box, Send to guest (or
// Ctrl+Enter): the text becomes the guest's clipboard (and its primary selection: a terminal pastes it with
// Shift+Insert or the middle button). Get from guest fills the box with what the guest holds (its clipboard, or
// the text last selected there) and, where the browser allows it, puts it on the browser's clipboard too.
//
//   clipboardFor(host, name, kind)   the console now shows this capsule: the box is there for a screen. host:
//                                    null for this host's capsule, else the peer's name (a URL: not yet known,
//                                    no box until the console knows the peer's name)
// #console-clip-state data-state: idle, busy, sent, received, too-large, failed; its text says which, with the
// size (a text over the limit is refused here first, and by the agent).

import * as api from "./api.js";
import { bytes } from "./format.js";

const $ = (id) => document.getElementById(id);
const target = { host: null, name: null };
let limit = 512 * 1024;     // the agent's limit (max_bytes), updated from each answer

function state(s, text) {
  const el = $("console-clip-state");
  el.dataset.state = s;
  el.textContent = text;
}

function failed(name, err) {
  if (target.name !== name) return;
  if (err.status === 413) state("too-large", `too large: ${err.message}`);
  else state("failed", `clipboard: ${err.message}`);
}

export function clipboardFor(host, name, kind) {
  const shown = kind === "screen" && name && !(host && host.includes("://"));
  $("console-clip").hidden = !shown;
  if (target.name !== name || target.host !== (host || null)) state("idle", "");
  target.host = shown ? host || null : null;
  target.name = shown ? name : null;
}

const ask = (host, name) => (host ? api.peerClipboard(host, name) : api.clipboard(name));
const tell = (host, name, text) => (host ? api.setPeerClipboard(host, name, text) : api.setClipboard(name, text));

async function send() {
  const { host, name } = target;
  if (!name) return;
  const text = $("console-clip-text").value;
  const size = new TextEncoder().encode(text).length;
  if (size > limit) {
    state("too-large", `too large: ${bytes(size)}, the clipboard takes at most ${bytes(limit)}`);
    return;
  }
  state("busy", "sending…");
  try {
    const r = await tell(host, name, text);
    limit = r.max_bytes;
    if (target.name === name) state("sent", `sent ${bytes(r.bytes)}: paste it in the guest`);
  } catch (err) {
    failed(name, err);
  }
}

async function get() {
  const { host, name } = target;
  if (!name) return;
  state("busy", "getting…");
  try {
    const r = await ask(host, name);
    limit = r.max_bytes;
    if (target.name !== name) return;
    $("console-clip-text").value = r.text;
    let where = "";
    try {
      await navigator.clipboard.writeText(r.text);
      where = ", also on this browser's clipboard";
    } catch {
      // not a secure page, or not allowed: the text is in the box
    }
    state("received", `received ${bytes(r.bytes)}${where}`);
  } catch (err) {
    failed(name, err);
  }
}

$("console-clip-send").addEventListener("click", send);
$("console-clip-get").addEventListener("click", get);
$("console-clip-text").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
    ev.preventDefault();
    send();
  }
});
