// The backups panel: this host's backup schedules with their last results and their backups (newest first),
// "Back up now", "Restore…" on each backup, and the host's verify job with "Verify now". The data is
// GET /api/backups; every button is one API call (the library call `capsule backup …` makes).
//
//   renderBackups(data, {onChange, onError})   draw (again) into #backups-view
//
// Rows are <tr data-job="NAME">, backups <li data-backup="NAME@V">, buttons carry data-action.

import * as api from "./api.js";
import { bytes, h, when } from "./format.js";

const $ = (id) => document.getElementById(id);
const busy = new Map();        // "run:NAME" | "restore:NAME@V" | "verify" -> what is being done
const open = new Set();        // jobs whose backup list is unfolded
let last = null;
let hooks = { onChange: () => {}, onError: () => {} };

export function renderBackups(data, callbacks = hooks) {
  last = data;
  hooks = callbacks;
  const view = $("backups-view");
  const verify = verifyLine(data.verify);
  if (data.jobs.length === 0) {
    view.replaceChildren(verify, h("p", { class: "empty" }, "No backup schedules yet: ",
      h("code", {}, "capsule backup schedule NAME --every daily --keep-daily 7")));
    return;
  }
  const head = h("tr", {}, ["Capsule", "Every", "Keep", "Copies to", "Next run", "Last run", "Result",
    "Guest paused", "New bytes", "Backups", ""].map((t) => h("th", {}, t)));
  view.replaceChildren(verify, h("table", {}, h("thead", {}, head), h("tbody", {}, data.jobs.map(jobRow))));
}

function verifyLine(v) {
  const doing = busy.get("verify");
  const button = h("button", { type: "button", class: "quiet", "data-action": "verify-backups",
    disabled: Boolean(doing), onclick: () => act("verify", "verifying", () => api.verifyBackups(), (r) =>
      (r.ok ? null : r.summary)) }, doing ? `${doing}…` : "Verify now");
  const text = v ? [`Verify job: ${v.calendar}, next ${v.next_run ? when(v.next_run) : "–"}`,
    v.last_run ? ` · last ${when(v.last_run)} ` : "",
    v.last_result && h("span", { class: `badge result-${v.last_result}`, "data-result": v.last_result },
      v.last_result),
    v.last_error ? ` ${v.last_error}` : ""]
    : ["No verify job: ", h("code", {}, "capsule backup verify --schedule 'Sun 04:00'")];
  return h("p", { class: "muted verify", "data-verify": v ? v.last_result || "never" : "none" }, ...text, " ",
    button);
}

function jobRow(j) {
  const doing = busy.get(`run:${j.capsule}`);
  const result = j.running_since ? h("span", { class: "badge state-busy" }, "running")
    : j.last_result ? h("span", { class: `badge result-${j.last_result.replace(" ", "-")}`,
      "data-result": j.last_result, title: j.last_error || "" }, j.last_result) : "–";
  const list = h("details", { open: open.has(j.capsule) },
    h("summary", {}, `${j.backups.length} backup${j.backups.length === 1 ? "" : "s"}`),
    h("ul", { class: "versions" }, j.backups.map((b) => backupItem(j.capsule, b))));
  list.addEventListener("toggle", () => (list.open ? open.add(j.capsule) : open.delete(j.capsule)));
  return h("tr", { "data-job": j.capsule },
    h("td", {}, h("strong", {}, j.capsule), h("div", { class: "muted" }, j.mode)),
    h("td", {}, j.normalized),
    h("td", {}, j.policy_text),
    h("td", {}, j.target ? [j.target, h("div", { class: "muted" }, `keeps ${j.target_policy_text}`)] : "–"),
    h("td", {}, j.next_run ? when(j.next_run) : "–"),
    h("td", {}, j.last_run ? when(j.last_run) : "–",
      j.last_duration !== null ? h("div", { class: "muted" }, `took ${j.last_duration.toFixed(1)} s`) : null),
    h("td", {}, result, j.last_error ? h("div", { class: "error" }, j.last_error) : null),
    h("td", { class: "num" }, j.last_pause !== null ? `${j.last_pause.toFixed(2)} s` : "–"),
    h("td", { class: "num" }, bytes(j.last_bytes)),
    h("td", {}, list),
    h("td", { class: "actions" }, h("button", { type: "button", "data-action": "backup-now", disabled: Boolean(doing),
      onclick: () => act(`run:${j.capsule}`, "backing up", () => api.runBackup(j.capsule),
        (r) => (r.ok ? null : `backup of ${j.capsule} failed: ${r.error}`)) }, doing ? `${doing}…` : "Back up now")));
}

function backupItem(capsule, b) {
  const key = `restore:${b.ref}`;
  const doing = busy.get(key);
  return h("li", { "data-backup": b.ref },
    h("strong", {}, b.ref), " ", h("span", { class: "muted" }, `${when(b.created)} · ${b.note}`), " ",
    h("button", { type: "button", class: "quiet", "data-action": "restore", disabled: Boolean(doing),
      onclick: () => restore(capsule, b, key) }, doing ? `${doing}…` : "Restore…"));
}

async function restore(capsule, b, key) {
  const dialog = $("restore-dialog");
  const form = dialog.querySelector("form");
  form.reset();
  dialog.querySelector("[data-field=backup]").textContent = b.ref;
  dialog.querySelector("[data-field=capsule]").textContent = capsule;
  $("restore-as").value = `${capsule}-${b.version}`;
  const answer = await new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? new FormData(form) : null),
      { once: true });
    dialog.showModal();
  });
  if (!answer) return;
  const latest = answer.get("how") === "latest";
  const body = { version: b.version, as_name: latest ? null : String(answer.get("as_name")).trim() };
  await act(key, "restoring", () => api.restoreBackup(capsule, body), () => null);
}

async function act(key, label, call, failure) {
  busy.set(key, label);
  if (last) renderBackups(last, hooks);
  try {
    const message = failure(await call());
    if (message) hooks.onError(message);
  } catch (err) {
    hooks.onError(err.status === 401 ? err : `${label}: ${err.message}`);
  } finally {
    busy.delete(key);
  }
  hooks.onChange();
}
