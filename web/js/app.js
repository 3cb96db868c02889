// The dashboard page: sign-in, then this host's capsules and each peer's, refreshed every few seconds.
// All data comes from the JSON API (api.js); nothing here decides anything the API does not.

import * as api from "./api.js";
import { bytes, h, when } from "./format.js";
import { openMigrate } from "./migrate.js";
import { bringButton } from "./bring.js";
import { renderBackups } from "./backups.js";
import { renderTree } from "./tree.js";

const REFRESH_MS = 3000;
const $ = (id) => document.getElementById(id);

const view = {
  session: null,       // {store_id, ...} once signed in
  local: null,         // this host's capsules (the API's answer) or null before the first answer
  peers: null,         // the peers (HostOut[]) or null
  peersError: null,
  busy: new Map(),     // capsule name -> what is being done to it ("starting", …)
  open: new Set(),     // "host/capsule" whose version list is unfolded
  timer: null,
  loading: false,
  treeHost: null,      // whose hierarchy the tree card shows: null = this host, else a peer's name
};

const running = (c) => c.state === "running";
const startable = (c) => c.state === "stopped" || c.state === "suspended";

// The actions on this host's capsules: each is one API call (the same library call as the CLI's verb).
// "Console" opens the live console panel (console.js); an action with `run` opens its own view instead
// (Migrate…: migrate.js, progress phase by phase; when the capsule runs elsewhere the console follows it).
const ACTIONS = [
  { verb: "console", label: "Console", when: running, run: (c) => showConsole(c.name) },
  { verb: "start", label: "Start", busy: "starting", when: startable },
  { verb: "suspend", label: "Suspend", busy: "suspending", when: running },
  { verb: "suspend", label: "Suspend + balloon", busy: "ballooning and suspending", when: running,
    body: { balloon: true } },
  { verb: "snapshot", label: "Snapshot", busy: "snapshotting", when: running },
  { verb: "stop", label: "Stop", busy: "stopping", when: (c) => running(c) || c.state === "crashed" },
  { verb: "derive", label: "Derive…", busy: "deriving", when: () => true, ask: askDerive },
  { verb: "rm", label: "Remove…", busy: "removing", when: (c) => !running(c), ask: askRemove },
  { verb: "migrate", label: "Migrate…", when: running,
    run: (c) => openMigrate(c, view.peers, { onEnd: () => { view.loading = false; refresh(); } }) },
];

// The console (console.js) loads on first use: a host without the page's npm libraries (noVNC, xterm.js) still
// shows everything else.
let consoleModule = null;

async function showConsole(name, host = null) {
  try {
    consoleModule = consoleModule || await import("./console.js");
  } catch (err) {
    showError(`the console cannot load (${err.message}): on this host, run \`make web\` (npm ci in web/)`);
    return;
  }
  await consoleModule.openConsole(host, name);
}

// -- alerts -------------------------------------------------------------------------------------------
function showError(message) {
  $("alert-text").textContent = message;
  $("alert").hidden = false;
}

function clearError() {
  $("alert").hidden = true;
  $("alert-text").textContent = "";
}

// -- sign-in ------------------------------------------------------------------------------------------
function showSignIn(message = "") {
  stopRefreshing();
  if (consoleModule) consoleModule.closeConsole();
  view.session = null;
  view.local = view.peers = null;
  $("sign-in").hidden = false;
  $("hosts").hidden = true;
  $("tree").hidden = true;
  $("backups").hidden = true;
  $("sign-out").hidden = true;
  $("whoami").textContent = "";
  $("refreshed").textContent = "";
  $("sign-in-error").textContent = message;
  $("user").focus();
}

function showDashboard(session) {
  view.session = session;
  $("sign-in").hidden = true;
  $("hosts").hidden = false;
  $("tree").hidden = session.role === "owner";
  $("backups").hidden = false;
  $("sign-out").hidden = false;
  $("whoami").textContent = session.user ? `${session.user} (${session.role}) on host ${session.store_id}`
    : `host ${session.store_id}`;
  render();
  refresh();
  view.timer = setInterval(refresh, REFRESH_MS);
}

function stopRefreshing() {
  if (view.timer) clearInterval(view.timer);
  view.timer = null;
}

$("sign-in-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const user = $("user").value.trim();
  const body = user ? { user, password: $("password").value } : { token: $("token").value.trim() };
  try {
    const session = await api.signIn(body);
    for (const id of ["password", "token"]) $(id).value = "";
    clearError();
    showDashboard(session);
  } catch (err) {
    const wrong = user ? "Wrong user name or password." : "That is not this host's token.";
    // a 401 with a reason (the host's token retired by the first admin) says it; a bare one says nothing more
    const retired = err.status === 401 && /capsule token create/.test(err.message);
    $("sign-in-error").textContent = err.status === 401 && !retired ? wrong : err.message;
  }
});

$("sign-out").addEventListener("click", async () => {
  try {
    await api.signOut();
  } catch (err) {
    if (err.status !== 401) showError(err.message);
  }
  showSignIn();
});

$("alert-close").addEventListener("click", clearError);

// -- loading ------------------------------------------------------------------------------------------
async function refresh() {
  if (view.loading || !view.session) return;
  view.loading = true;
  try {
    // this host first: a slow peer never holds back the local list
    const peers = api.peers().then(
      (list) => { view.peers = list; view.peersError = null; },
      (err) => { if (err.status === 401) throw err; view.peersError = err.message; });
    // the whole hierarchy is for operators and admins: an owner sees only its capsules
    const owner = view.session && view.session.role === "owner";
    const whose = view.treeHost;
    const tree = owner ? Promise.resolve() : (whose ? api.peerTree(whose) : api.tree()).then((g) => {
      if (view.treeHost === whose) renderTree(g);
    }, (err) => {
      if (err.status === 401) throw err;
      $("tree-selection").textContent = `The hierarchy${whose ? ` of ${whose}` : ""} failed: ${err.message}`;
    });
    const backups = api.backups().then((data) => renderBackups(data, backupHooks), (err) => {
      if (err.status === 401) throw err;
      $("backups-view").textContent = `The backups failed: ${err.message}`;
    });
    view.local = await api.capsules();
    render();
    await tree;
    await backups;
    await peers;
    if (!owner) treePicker();
    $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
    render();
  } catch (err) {
    if (err.status === 401) showSignIn("Your session ended: sign in again.");
    else showError(err.message);
  } finally {
    view.loading = false;
  }
}

// The tree card's host picker: this host's hierarchy or a reachable peer's (asked through this host), so a user
// sees which versions exist where. #tree-host: <select> of "" (this host) and the peers' names.
function treePicker() {
  let select = $("tree-host");
  if (!select) {
    select = h("select", { id: "tree-host", "aria-label": "Whose hierarchy" });
    select.addEventListener("change", () => {
      view.treeHost = select.value || null;
      $("tree").querySelector("h2").textContent = `Hierarchy on ${view.treeHost || "this host"}`;
      $("tree-selection").textContent = "";
      view.loading = false;
      refresh();
    });
    $("tree").querySelector("header h2").after(select);
  }
  const names = (view.peers || []).filter((p) => p.reachable).map((p) => p.name);
  const want = ["", ...names].join("\n");
  if (select.dataset.options !== want) {
    select.dataset.options = want;
    select.replaceChildren(h("option", { value: "" }, "this host"), ...names.map((n) => h("option", { value: n }, n)));
    if (view.treeHost && !names.includes(view.treeHost)) view.treeHost = null;   // gone or unreachable
    select.value = view.treeHost || "";
    $("tree").querySelector("h2").textContent = `Hierarchy on ${view.treeHost || "this host"}`;
  }
}

// the backups panel's buttons (backups.js): an error is shown, a change refreshes the whole page
const backupHooks = {
  onChange: () => { view.loading = false; refresh(); },
  onError: (err) => (err && err.status === 401 ? showSignIn("Your session ended: sign in again.") : showError(err)),
};

async function act(capsule, action) {
  if (action.run) return action.run(capsule);
  let body = action.body || {};
  if (action.ask) {
    body = await action.ask(capsule);
    if (!body) return;
  }
  view.busy.set(capsule.name, action.busy);
  render();
  try {
    await api.action(capsule.name, action.verb, body);
    clearError();
  } catch (err) {
    if (err.status === 401) {
      showSignIn("Your session ended: sign in again.");
      return;
    }
    showError(`${action.label.replace("…", "")} ${capsule.name}: ${err.message}`);
  } finally {
    view.busy.delete(capsule.name);
  }
  view.loading = false;
  await refresh();
}

// -- dialogs ------------------------------------------------------------------------------------------
function ask(dialog, prepare) {
  return new Promise((resolve) => {
    const form = dialog.querySelector("form");
    form.reset();
    prepare(dialog);
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? new FormData(form) : null),
      { once: true });
    dialog.returnValue = "";       // Esc keeps the last returnValue: never an action nobody confirmed
    dialog.showModal();
  });
}

async function askDerive(capsule) {
  const data = await ask($("derive-dialog"), (d) => {
    d.querySelector("[data-field=parent]").textContent = `${capsule.name}@${capsule.latest}`;
  });
  return data && { child: String(data.get("child")).trim() };
}

async function askRemove(capsule) {
  const data = await ask($("rm-dialog"), (d) => {
    d.querySelector("[data-field=name]").textContent = capsule.name;
    const select = d.querySelector("select");
    select.replaceChildren(h("option", { value: "" }, `the whole capsule (${capsule.version_count} versions)`),
      ...capsule.versions.map((v) => h("option", { value: v.version }, `only ${v.ref}`)));
  });
  if (!data) return null;
  const version = data.get("version");
  return { version: version ? Number(version) : null, promote: data.get("promote") === "on" };
}

// -- rendering ----------------------------------------------------------------------------------------
function render() {
  const root = $("hosts");
  const focused = focusedControl(root);
  root.replaceChildren(
    hostSection({ key: "local", title: "This host", subtitle: view.session && `store ${view.session.store_id}`,
      capsules: view.local, actions: true }),
    ...peerSections());
  const again = focused && root.querySelector(focused);
  if (again) again.focus({ preventScroll: true });
}

// The lists are drawn anew on every refresh: the control that has the keyboard's focus there, as a selector
// (its host, its capsule, its action) that finds its successor, so the focus stays put.
function focusedControl(root) {
  const el = document.activeElement;
  if (!el || el === root || !root.contains(el)) return null;
  const section = el.closest("section[data-host]");
  const row = el.closest("tr[data-capsule]");
  if (!section) return null;
  return `section[data-host="${CSS.escape(section.dataset.host)}"] `
    + (row ? `tr[data-capsule="${CSS.escape(row.dataset.capsule)}"] ` : "")
    + (el.dataset.action ? `[data-action="${CSS.escape(el.dataset.action)}"]` : el.tagName.toLowerCase());
}

function peerSections() {
  if (view.peersError) {
    return [h("section", { class: "card host unreachable" }, h("p", { class: "error" },
      `The list of other hosts failed: ${view.peersError}`))];
  }
  if (!view.peers) return [];
  if (view.peers.length === 0) {
    return [h("p", { class: "muted" }, "No other hosts yet: add one with ",
      h("code", {}, "capsule host add NAME http://HOST:PORT --token-file FILE"), ".")];
  }
  return view.peers.map((p) => hostSection({
    key: p.name, title: p.name, subtitle: `${p.url} · store ${p.store_id}`, capsules: p.capsules,
    unreachable: p.reachable ? null : p.error || "no answer", link: p.url,
  }));
}

function hostSection({ key, title, subtitle, capsules, actions = false, unreachable = null, link = null }) {
  const head = h("header", {},
    h("h2", {}, title),
    subtitle && h("span", { class: "muted" }, subtitle),
    unreachable && h("span", { class: "badge state-unreachable", "data-state": "unreachable" }, "unreachable"),
    link && !unreachable && h("a", { href: link, target: "_blank", rel: "noopener noreferrer" }, "open its dashboard"));
  let body;
  if (unreachable) body = h("p", { class: "error" }, unreachable);
  else if (capsules === null || capsules === undefined) body = h("p", { class: "empty" }, "loading…");
  else if (capsules.length === 0) body = h("p", { class: "empty" }, "no capsules");
  else body = capsuleTable(key, capsules, actions);
  return h("section", { class: `card host${unreachable ? " unreachable" : ""}`, "data-host": key,
    "data-reachable": unreachable ? "no" : "yes" }, head, body);
}

function capsuleTable(hostKey, capsules, actions) {
  const head = h("tr", {}, ["Capsule", "State", "Latest", "Memory", "Disk", "Depends on", "Versions"]
    .map((t) => h("th", {}, t)), h("th", {}, "Actions"));
  return h("table", {}, h("thead", {}, head),
    h("tbody", {}, capsules.map((c) => capsuleRow(hostKey, c, actions))));
}

function capsuleRow(hostKey, c, actions) {
  const latest = c.versions.find((v) => v.version === c.latest) || c.versions[c.versions.length - 1];
  const busy = view.busy.get(c.name);
  const state = busy ? h("span", { class: "badge state-busy", "data-state": "busy" }, `${busy}…`)
    : h("span", { class: `badge state-${c.state}`, "data-state": c.state }, c.state);
  const cells = [
    h("td", {}, h("strong", {}, c.name), c.domain && h("div", { class: "muted" }, c.domain)),
    h("td", {}, state),
    h("td", { class: "num" }, `@${c.latest}`, latest && h("div", { class: "muted" },
      latest.active ? "with memory" : "disk only")),
    h("td", { class: "num" }, latest && latest.memory ? bytes(latest.memory.allocated) : "–"),
    h("td", { class: "num" }, latest ? bytes(latest.disk_bytes) : "–"),
    h("td", {}, dependsOn(latest)),
    h("td", {}, versionList(hostKey, c)),
  ];
  if (actions) {
    cells.push(h("td", { class: "actions" }, ACTIONS.filter((a) => a.when(c)).map((a) => h("button", {
      type: "button", class: a.verb === "rm" ? "quiet" : null, "data-action": a.verb + (a.body ? "-balloon" : ""),
      disabled: Boolean(busy),
      onclick: () => act(c, a),
    }, a.label))));
  } else {   // a peer's capsule: its console, relayed through this host's agent; Bring here (bring.js)
    const staff = view.session && view.session.role !== "owner";
    cells.push(h("td", { class: "actions" }, running(c) && h("button", {
      type: "button", "data-action": "console", onclick: () => showConsole(c.name, hostKey),
    }, "Console"), ...(running(c) && staff ? bringButton(hostKey, c, {
      onEnd: () => { view.loading = false; refresh(); }, onChange: render,
    }) : [])));
  }
  return h("tr", { "data-capsule": c.name }, cells);
}

function dependsOn(v) {
  if (!v || v.depends_on.length === 0) return h("span", { class: "muted" }, "this host only");
  return v.depends_on.map((d) => h("div", {}, d.host ? `${d.host} ` : "", h("span", { class: "muted" }, d.url)));
}

function versionList(hostKey, c) {
  const key = `${hostKey}/${c.name}`;
  const details = h("details", { open: view.open.has(key) },
    h("summary", {}, `${c.version_count} version${c.version_count === 1 ? "" : "s"}`),
    h("ul", { class: "versions" }, [...c.versions].reverse().map((v) => h("li", {},
      h("strong", {}, v.ref), " ", v.active ? "memory " + bytes(v.memory && v.memory.allocated) : "disk only",
      ` · disk ${bytes(v.disk_bytes)}`,
      v.depends_on.length ? ` · needs ${v.depends_on.map((d) => d.host || d.url).join(", ")}` : "",
      h("div", { class: "muted" }, `${when(v.created)} · ${v.note}`)))));
  details.addEventListener("toggle", () => {
    if (details.open) view.open.add(key);
    else view.open.delete(key);
  });
  return details;
}

// -- start ---------------------------------------------------------------------------------------------
api.currentSession().then(showDashboard, (err) => showSignIn(err.status === 401 ? "" : err.message));
