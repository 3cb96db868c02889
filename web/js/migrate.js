// The migrate dialog: pick the destination (one of this host's peers), then how: Live (the default: it keeps
// running and pauses under a second; greyed out with the reason when the destination's pre-check refuses it,
// GET /api/capsules/{name}/migrate/check?to=HOST), Offline: full or Offline: demand-paged (balloon on or off,
// offline only); then the migration, phase by phase (Server-Sent Events from /api/migrations/{id}/events):
// bytes on the wire, bytes the destination found locally, an ETA, a live move's pre-copy rounds (bytes, dirty
// rate) and its switchover's measured pause, and Cancel. At the end it says where the capsule runs now.
//
// The choice is a modal dialog; the migration's progress is not: the same <dialog> is shown with show() as a
// panel in the page's flow, right under the console panel (#console), so it covers nothing and the console
// stays usable while the capsule moves (during a live move's pre-copy the guest runs here, and takes keys).
// Its buttons are in the page's tab order. A live move's rounds are listed as they go (the bytes each round
// sent, the rate the guest dirtied memory at), with the memory still to send, the disks' writes since T0, the
// switchover's measured pause, and during post-copy the memory still at the source.
//
// The console follows the capsule. When it runs at the destination, this module calls
//     window.capsuleConsole.openConsole(hostUrl, name)   when the page has set window.capsuleConsole, else
//     openConsole(hostUrl, name) exported by ./console.js (loaded with import() on first use), if it exists;
// with hostUrl the destination agent's URL (where its dashboard and console live) and name the capsule.
// Neither is required: without a console module the migration works the same and nothing is opened.
// When a cancel or a failure leaves the capsule running here again, a console showing it reconnects here.

import * as api from "./api.js";
import { bytes, h } from "./format.js";

const LABELS = {
  balloon: "Balloon", save: "Save memory here", memory: "Memory image", disk: "Disks", resume: "Resume there",
};
const LIVE_LABELS = {
  precheck: "Pre-check", disks: "Disks at T0", memory: "Memory (it keeps running)", switchover: "Switchover",
  postcopy: "Post-copy",
};
const OUTCOME = { done: "Done", cancelled: "Cancelled", failed: "Failed" };
const PAGE = 4096;   // bytes per guest page: libvirt's dirty rate is in pages per second

let dialog = null;
let current = null;   // {id, stream, onEnd}
let rounds = new Map();  // a live move's pre-copy rounds seen so far: round → {bytes, wireFrom, wireTo, rate}
let rateMeasured = false;  // libvirt reports 0 pages/s until QEMU has measured the dirty rate once

// -- the console hook ------------------------------------------------------------------------------------
export async function consoleFollows(hostUrl, name) {
  let open = window.capsuleConsole && window.capsuleConsole.openConsole;
  if (typeof open !== "function") {
    try {
      open = (await import("./console.js")).openConsole;
    } catch {
      open = null;  // no console module on this page: nothing to follow
    }
  }
  if (typeof open !== "function") return false;
  try {
    await open(hostUrl, name);
    return true;
  } catch (err) {
    console.warn(`the console could not follow ${name} to ${hostUrl}: ${err}`);
    return false;
  }
}

// After a cancel (or a failure) that left the capsule running here again, a console that was showing it
// reconnects to it here. Returns whether it did.
export async function consoleReturns(name) {
  let mod = null;
  try {
    mod = await import("./console.js");
  } catch {
    return false;
  }
  if (mod.consoleCapsule() !== name) return false;
  try {
    await mod.openConsole(null, name);
    return true;
  } catch (err) {
    console.warn(`the console could not reconnect to ${name} here: ${err}`);
    return false;
  }
}

// -- the dialog ------------------------------------------------------------------------------------------
// The "How" of a move, for Migrate and Bring here: live, or offline (full or demand-paged, ballooned or not);
// the capsule resumes ``where`` ("there", "here").
export function kindChoices(where) {
  return [
    h("label", {}, "How"),
    h("label", { class: "check", "data-kind": "live" },
      h("input", { type: "radio", name: "kind", value: "live", checked: true }),
      " Live: it keeps running, pauses under a second"),
    h("p", { class: "muted", "data-field": "live-refused", hidden: true }),
    h("label", { class: "check" }, h("input", { type: "radio", name: "kind", value: "full" }),
      ` Offline: full — suspend, copy everything, then resume ${where}`),
    h("label", { class: "check" }, h("input", { type: "radio", name: "kind", value: "demand" }),
      ` Offline: demand-paged — suspend, copy the memory, resume ${where} at once, disk blocks follow as read`),
    h("label", { class: "check" }, h("input", { type: "checkbox", name: "balloon", disabled: true }),
      " Balloon first (offline only: less memory to move)"),
  ];
}

function build() {
  const choose = h("form", { method: "dialog", class: "migrate-choose" },
    h("h3", {}, "Migrate ", h("span", { "data-field": "name" })),
    h("label", { for: "migrate-to" }, "Destination host"),
    h("select", { id: "migrate-to", name: "to", required: true }),
    ...kindChoices("there"),
    h("p", { class: "error", "data-field": "choose-error" }),
    h("menu", {},
      h("button", { value: "cancel", formnovalidate: true, class: "quiet" }, "Cancel"),
      h("button", { value: "ok", "data-action": "start-migration" }, "Migrate")));
  const progress = h("div", { class: "migrate-progress", hidden: true },
    h("h3", {}, "Migrating ", h("span", { "data-field": "name" }), " to ", h("span", { "data-field": "to" })),
    h("ol", { class: "phases" }),
    h("div", { class: "bar" }, h("div", { class: "fill" })),
    h("dl", { class: "counters" },
      h("dt", {}, "On the wire"), h("dd", { "data-field": "wire" }, "–"),
      h("dt", {}, "Found locally"), h("dd", { "data-field": "local" }, "–"),
      h("dt", {}, "Progress"), h("dd", { "data-field": "done" }, "–"),
      h("dt", {}, "Time left"), h("dd", { "data-field": "eta" }, "–"),
      h("dt", { "data-live": "" }, "Memory still to send"),
      h("dd", { "data-live": "", "data-field": "remaining" }, "–"),
      h("dt", { "data-live": "" }, "Disk writes since T0"),
      h("dd", { "data-live": "", "data-field": "disk" }, "–")),
    h("table", { class: "rounds", "data-field": "rounds", hidden: true },
      h("caption", {}, "Pre-copy rounds (the guest runs here meanwhile)"),
      h("thead", {}, h("tr", {}, h("th", {}, "Round"), h("th", {}, "Memory sent"), h("th", {}, "On the wire"),
        h("th", {}, "Dirty rate"))),
      h("tbody", {})),
    h("p", { class: "migrate-message", role: "status", "aria-live": "polite", "data-field": "message" }),
    h("menu", {},
      h("button", { type: "button", class: "danger", "data-action": "cancel-migration", onclick: cancel },
        "Cancel migration"),
      h("button", { type: "button", "data-action": "close-migration", hidden: true, onclick: () => dialog.close() },
        "Close")));
  const d = h("dialog", { id: "migrate-dialog", class: "migrate", "aria-labelledby": "migrate-title" }, choose,
    progress);
  progress.querySelector("h3").id = "migrate-title";
  progress.querySelector("h3").tabIndex = -1;   // focusable by the script, not a tab stop
  d.addEventListener("cancel", (ev) => {  // Escape: never hides a migration that is still running
    if (current) ev.preventDefault();
  });
  document.body.append(d);
  return d;
}

const field = (name) => dialog.querySelector(`.migrate-progress [data-field=${name}]`);

// Open the dialog for a running capsule of this host. peers: the API's /api/hosts answer (HostOut[]), asked
// for here when the page has none yet. onEnd(migration) is called when the migration has ended, whatever
// the outcome.
export async function openMigrate(capsule, peers, { onEnd = () => {} } = {}) {
  dialog = dialog || build();
  if (current) {  // one at a time: show the running one
    dock();
    return;
  }
  if (!peers) {
    try {
      peers = await api.peers();
    } catch {
      peers = [];
    }
  }
  const form = dialog.querySelector("form");
  form.reset();
  form.hidden = false;
  dialog.querySelector(".migrate-progress").hidden = true;
  dialog.querySelectorAll("[data-field=name]").forEach((el) => { el.textContent = capsule.name; });
  form.querySelector("[data-field=choose-error]").textContent = "";
  const select = form.querySelector("select");
  const usable = (peers || []).filter((p) => p.reachable);
  select.replaceChildren(...(peers || []).map((p) => h("option", { value: p.name, disabled: !p.reachable },
    p.reachable ? `${p.name} (${p.url})` : `${p.name} (unreachable)`)));
  const go = form.querySelector("[data-action=start-migration]");
  go.disabled = usable.length === 0;
  if (usable.length === 0) {
    form.querySelector("[data-field=choose-error]").textContent =
      "No reachable host to move to: add one with `capsule host add`.";
  } else {
    select.value = usable[0].name;
  }
  const kinds = form.querySelectorAll("input[name=kind]");
  const balloon = form.querySelector("input[name=balloon]");
  const kindChanged = () => { balloon.disabled = form.querySelector("input[name=kind]:checked").value === "live"; };
  kinds.forEach((k) => { k.onchange = kindChanged; });
  kindChanged();
  select.onchange = () => checkLive(form, capsule.name, select.value);
  if (usable.length) checkLive(form, capsule.name, select.value);
  // the form's submit (it closes the modal dialog: method=dialog) starts the move; one handler at a time
  form.onsubmit = async (ev) => {
    if (!ev.submitter || ev.submitter.value !== "ok" || current) return;
    const data = new FormData(form);
    const kind = String(data.get("kind"));
    const body = kind === "live" ? { to: String(data.get("to")), live: true }
      : { to: String(data.get("to")), live: false, mode: kind, balloon: data.get("balloon") === "on" };
    try {
      const m = await api.migrate(capsule.name, body);
      follow(m, onEnd);
    } catch (err) {
      openMigrate(capsule, peers, { onEnd });
      form.querySelector("[data-field=choose-error]").textContent = err.message;
    }
  };
  dialog.returnValue = "";
  if (dialog.open) dialog.close();
  dialog.classList.remove("docked");
  dialog.showModal();
}

// The progress: the dialog shown without being modal, in the page's flow under the console panel (or at the
// top of the page when there is none), so that nothing else is blocked or covered while the capsule moves.
// Focus goes to its title (Tab from there reaches Cancel): never onto Cancel itself, where a key meant for
// something else would cancel the move.
function dock() {
  const anchor = document.getElementById("console");
  const main = document.querySelector("main");
  if (anchor && anchor.nextElementSibling !== dialog) anchor.after(dialog);
  else if (!anchor && main && dialog.parentElement !== main) main.prepend(dialog);
  if (dialog.open && !dialog.classList.contains("docked")) dialog.close();
  dialog.classList.add("docked");
  if (!dialog.open) dialog.show();
  dialog.querySelector("#migrate-title").focus({ preventScroll: true });
  dialog.scrollIntoView({ block: "nearest" });
}

// Ask the destination's pre-check for a live move to host; refused: the Live choice is greyed out with the
// reason (and an offline choice is picked instead). A later answer for another host is ignored.
async function checkLive(form, name, host) {
  form.dataset.checking = host;
  let refusals = [];
  try {
    const answer = await api.migrateCheck(name, host);
    refusals = answer.refusals || [];
  } catch (err) {
    refusals = [{ reason: "unreachable", detail: err.message }];
  }
  if (form.dataset.checking !== host) return;
  delete form.dataset.checking;
  showLiveRefusals(form, refusals);
}

// A move form's Live choice greyed out with the pre-check's reasons (none: offered), and the full offline move
// picked instead where Live was, with its balloon choice; for Migrate and Bring here.
export function showLiveRefusals(form, refusals) {
  const live = form.querySelector("input[name=kind][value=live]");
  const why = form.querySelector("[data-field=live-refused]");
  live.disabled = refusals.length > 0;
  live.closest("label").dataset.refused = refusals.map((r) => r.reason).join(" ");
  why.hidden = refusals.length === 0;
  why.textContent = refusals.map((r) => `Live is not possible: ${r.detail}`).join(" ");
  if (live.disabled && live.checked) {
    form.querySelector("input[name=kind][value=full]").checked = true;
    form.querySelector("input[name=balloon]").disabled = false;
  }
}

// Follow a peer's migration of its capsule to this host (Bring here: bring.js): the same progress, phases and
// Cancel, asked of the peer through this agent (/api/hosts/HOST/migrations/…); when it is done the console
// opens on the capsule here. m: the answer of POST /api/hosts/HOST/capsules/NAME/bring (m.host: the peer).
export function followBring(m, { onEnd = () => {} } = {}) {
  dialog = dialog || build();
  follow(m, onEnd, m.host);
}

const migrationApi = (via) => (via ? {
  path: `/api/hosts/${encodeURIComponent(via)}/migrations/`,
  get: (id) => api.peerMigration(via, id), cancel: (id) => api.cancelPeerMigration(via, id),
} : { path: "/api/migrations/", get: api.migration, cancel: api.cancelMigration });

function follow(m, onEnd, via = null) {
  current = { id: m.id, stream: null, onEnd, via };
  import("./console.js").then((mod) => mod.consoleMoving(m.capsule, m.to), () => {});
  dialog.querySelector("form").hidden = true;
  dialog.querySelector(".migrate-progress").hidden = false;
  dialog.querySelector(".migrate-progress h3").replaceChildren(...(via ? ["Bringing ", m.capsule, " here from ", via]
    : ["Migrating ", h("span", { "data-field": "name" }, m.capsule), " to ", h("span", { "data-field": "to" }, m.to)]));
  dialog.querySelector("[data-action=cancel-migration]").hidden = false;
  dialog.querySelector("[data-action=cancel-migration]").disabled = false;
  dialog.querySelector("[data-action=close-migration]").hidden = true;
  rounds = new Map();
  rateMeasured = false;
  const table = dialog.querySelector("[data-field=rounds]");
  table.querySelector("tbody").replaceChildren();
  table.hidden = true;
  const live = m.progress.phases.includes("precheck");
  dialog.querySelectorAll(".migrate-progress [data-live]").forEach((el) => { el.hidden = !live; });
  show(m);
  dock();
  const stream = new EventSource(`${migrationApi(via).path}${encodeURIComponent(m.id)}/events`);
  current.stream = stream;
  stream.addEventListener("progress", (ev) => show(JSON.parse(ev.data)));
  stream.addEventListener("error", async () => {
    // the stream broke (the browser retries by itself); make sure a session that ended is noticed
    try {
      show(await migrationApi(via).get(m.id));
    } catch (err) {
      if (err.status === 401) end(null, "Your session ended: sign in again.");
    }
  });
}

let lastSeq = -1;

function show(m) {
  const p = m.progress;
  if (!current || m.id !== current.id || p.seq < lastSeq) return;  // never backwards
  lastSeq = p.seq;
  const list = dialog.querySelector("ol.phases");
  list.replaceChildren(...p.phases.map((name, i) => {
    let state = "todo";
    if (i < p.index || (i === p.index && p.outcome === "done")) state = "done";
    else if (i === p.index) state = p.outcome ? p.outcome : "current";
    const live = p.phases.includes("precheck");
    let detail = i === p.index && p.phase_total ? ` · ${bytes(p.phase_done)} of ${bytes(p.phase_total)}` : "";
    if (live && name === "memory" && p.round !== null && p.round !== undefined) {
      detail = ` · round ${p.round}: ${bytes(p.round_bytes)} sent; dirty rate ${dirtyRate(p.dirty_rate)}`;
    }
    if (live && name === "switchover" && p.pause_ms !== null && p.pause_ms !== undefined) {
      detail = ` · paused ${p.pause_ms} ms`;
    }
    if (live && name === "postcopy" && i === p.index && p.remaining_bytes !== null
        && p.remaining_bytes !== undefined) {
      detail = ` · ${bytes(p.remaining_bytes)} of memory still at the source (fetched as the guest touches it)`;
    }
    return h("li", { "data-phase": name, "data-state": state }, (live ? LIVE_LABELS : LABELS)[name] || name,
      h("span", { class: "muted", "data-field": "phase-detail" }, detail));
  }));
  field("wire").textContent = bytes(p.wire_bytes);
  field("local").textContent = bytes(p.local_bytes);
  field("done").textContent = p.total_bytes ? `${bytes(p.done_bytes)} of ${bytes(p.total_bytes)}` : "–";
  field("eta").textContent = p.outcome ? "–" : p.eta_seconds === null ? "estimating…" : `about ${Math.ceil(p.eta_seconds)} s`;
  const frac = p.outcome === "done" ? 1 : p.total_bytes ? p.done_bytes / p.total_bytes : 0;
  dialog.querySelector(".bar .fill").style.width = `${Math.round(frac * 100)}%`;
  dialog.querySelector(".bar").dataset.outcome = p.outcome || "";
  dialog.querySelector("[data-action=cancel-migration]").disabled = !p.cancellable;
  field("message").textContent = p.outcome ? "" : p.message;
  if (p.phases.includes("precheck")) showLive(p);
  if (p.outcome) end(m);
}

// "1,234 pages/s (4.8 MiB/s)": the rate the guest dirties memory at (libvirt's, in pages per second), and what
// that is in bytes
function dirtyRate(rate) {
  if (rate === null || rate === undefined || (rate === 0 && !rateMeasured)) return "not measured yet";
  return `${rate.toLocaleString("en")} pages/s (${bytes(rate * PAGE)}/s)`;
}

// A live move's figures: what remains, the disks' writes since T0, and one row per pre-copy round: the memory
// libvirt sent in it (counted from the first look at the round: a round shorter than that look shows little),
// what this host put on the wire from its start to the next round's (the memory codec's output, the disks'
// writes), and the rate the guest dirtied memory at, as last measured during it.
function showLive(p) {
  const pending = p.phase === "memory" || p.phase === "postcopy" ? p.remaining_bytes : null;
  field("remaining").textContent = pending === null || pending === undefined ? "–" : bytes(pending);
  field("disk").textContent = bytes(p.disk_bytes || 0);
  if (p.round === null || p.round === undefined) return;
  if (p.dirty_rate) rateMeasured = true;
  const unknown = p.dirty_rate === null || p.dirty_rate === undefined || (p.dirty_rate === 0 && !rateMeasured);
  for (const [n, r] of rounds) if (n < p.round && r.open) Object.assign(r, { open: false, wireTo: p.wire_bytes });
  const seen = rounds.get(p.round) || { bytes: 0, wireFrom: p.wire_bytes, wireTo: p.wire_bytes, rate: null,
    open: true };
  rounds.set(p.round, { ...seen, bytes: Math.max(seen.bytes, p.round_bytes || 0),
    wireTo: seen.open ? Math.max(seen.wireTo, p.wire_bytes) : seen.wireTo,
    rate: unknown ? seen.rate : p.dirty_rate });
  const table = dialog.querySelector("[data-field=rounds]");
  table.hidden = false;
  // libvirt's round 0 is the setup: a row only if it sent anything
  const shown = [...rounds.entries()].filter(([n, r]) => n > 0 || r.bytes > 0 || r.wireTo > r.wireFrom);
  table.querySelector("tbody").replaceChildren(...shown.map(([n, r]) =>
    h("tr", { "data-round": n, "data-current": n === p.round && !p.outcome && p.phase === "memory" ? "" : null },
      h("td", { class: "num" }, n), h("td", { class: "num" }, bytes(r.bytes)),
      h("td", { class: "num" }, bytes(r.wireTo - r.wireFrom)),
      h("td", { class: "num" }, dirtyRate(r.rate)))));
}

async function cancel() {
  if (!current) return;
  const button = dialog.querySelector("[data-action=cancel-migration]");
  button.disabled = true;
  try {
    show(await migrationApi(current.via).cancel(current.id));
    field("message").textContent = current && current.via ? `Cancelling: the capsule will run on ${current.via} again…`
      : "Cancelling: the capsule will run here again…";
  } catch (err) {
    field("message").textContent = err.message;
  }
}

async function end(m, why = "") {
  if (!current) return;
  const { stream, onEnd, via } = current;
  current = null;
  lastSeq = -1;
  if (stream) stream.close();
  dialog.querySelector("[data-action=cancel-migration]").hidden = true;
  dialog.querySelector("[data-action=close-migration]").hidden = false;
  const out = field("message");
  out.dataset.outcome = m ? m.progress.outcome : "failed";
  if (!m) {
    out.textContent = why;
  } else if (via) {
    endBring(m, out, via);
  } else if (m.progress.outcome === "done") {
    out.textContent = `${OUTCOME.done}: ${m.capsule} now runs on ${m.to} (${m.to_url}).`;
    if (await consoleFollows(m.to_url, m.capsule)) out.textContent += " The console follows it there.";
  } else {
    const back = m.progress.where === "source";
    const where = back ? "It runs here again." : "Check where it runs before retrying.";
    const detail = m.error ? m.error.detail : m.progress.message;
    out.textContent = `${OUTCOME[m.progress.outcome]}: ${where} ${detail || ""}`;
    if (back && await consoleReturns(m.capsule)) out.textContent += " The console is back on it here.";
  }
  onEnd(m);
}

async function endBring(m, out, via) {
  if (m.progress.outcome === "done") {
    out.textContent = `${OUTCOME.done}: ${m.capsule} now runs here (it came from ${via}).`;
    if (await consoleFollows(null, m.capsule)) out.textContent += " The console follows it here.";
    return;
  }
  const where = m.progress.where === "source" ? `It runs on ${via} again.` : "Check where it runs before retrying.";
  out.textContent = `${OUTCOME[m.progress.outcome]}: ${where} ${(m.error ? m.error.detail : m.progress.message) || ""}`;
}
