// Bring here: on a peer's running capsule, this page asks this host's agent to have the peer migrate it here
// (POST /api/hosts/HOST/capsules/NAME/bring: live by default, or offline), then shows its progress with the
// migrate dialog's follower (migrate.js followBring: the same phases, Cancel, and the console opening on the
// capsule here when it is done).
//
//   bringState(host, name, onChange)   whether it may come here, as last asked (GET …/bring/check, at most every
//                                      30 s per capsule; null until the first answer; onChange when one comes):
//                                      {to, refused: {reason, detail} | null, live_refusals: [{reason, detail}]}
//   openBring(host, capsule, { onEnd }) the dialog: how (Live greyed out with the reason when the peer's pre-check
//                                      refuses it), then the move
//
// The button is greyed out with the reason where the capsule cannot come (e.g. the peer does not know this host:
// `capsule host add` there names it).

import * as api from "./api.js";
import { h } from "./format.js";
import { followBring, kindChoices, showLiveRefusals } from "./migrate.js";

const CHECK_MS = 30000;
const checks = new Map();   // "host/name" -> {at, answer, asking}
let dialog = null;

function refusedBy(err) {
  return { to: null, refused: { reason: err.status === 403 ? "forbidden" : "unreachable", detail: err.message },
    live_refusals: [] };
}

function ask(host, name) {
  return api.bringCheck(host, name).then((a) => a, refusedBy);
}

export function bringState(host, name, onChange = () => {}) {
  const key = `${host}/${name}`;
  let entry = checks.get(key);
  if (!entry || (!entry.asking && Date.now() - entry.at > CHECK_MS)) {
    entry = { at: Date.now(), answer: entry ? entry.answer : null, asking: true };
    checks.set(key, entry);
    const asked = entry;
    ask(host, name).then((answer) => {
      const changed = JSON.stringify(answer) !== JSON.stringify(asked.answer);
      Object.assign(asked, { answer, asking: false, at: Date.now() });
      if (changed) onChange();
    });
  }
  return entry.answer;
}

// The "Bring here" button of a peer's capsule row.
export function bringButton(host, capsule, { onEnd = () => {}, onChange = () => {} } = {}) {
  const state = bringState(host, capsule.name, onChange);
  const refused = state ? state.refused : null;
  const why = state === null ? "checking whether it can come here…" : refused ? refused.detail : "";
  return [
    h("button", {
      type: "button", "data-action": "bring", disabled: state === null || Boolean(refused),
      "data-refused": refused ? refused.reason : "", title: why || `Move ${capsule.name} from ${host} to this host`,
      onclick: () => openBring(host, capsule, { onEnd }),
    }, "Bring here"),
    refused && h("p", { class: "muted", "data-field": "bring-refused" }, `Bring here is not possible: ${why}`),
  ];
}

function build() {
  const form = h("form", { method: "dialog", class: "bring-choose" },
    h("h3", {}, "Bring ", h("span", { "data-field": "name" }), " here from ", h("span", { "data-field": "host" })),
    ...kindChoices("here"),
    h("p", { class: "error", "data-field": "bring-error" }),
    h("menu", {},
      h("button", { value: "cancel", formnovalidate: true, class: "quiet" }, "Cancel"),
      h("button", { value: "ok", "data-action": "start-bring" }, "Bring here")));
  const d = h("dialog", { id: "bring-dialog", class: "migrate" }, form);
  document.body.append(d);
  return d;
}

export async function openBring(host, capsule, { onEnd = () => {} } = {}) {
  dialog = dialog || build();
  const form = dialog.querySelector("form");
  form.reset();
  dialog.querySelector("[data-field=name]").textContent = capsule.name;
  dialog.querySelector("[data-field=host]").textContent = host;
  const error = form.querySelector("[data-field=bring-error]");
  error.textContent = "";
  const go = form.querySelector("[data-action=start-bring]");
  const balloon = form.querySelector("input[name=balloon]");
  const kindChanged = () => { balloon.disabled = form.querySelector("input[name=kind]:checked").value === "live"; };
  form.querySelectorAll("input[name=kind]").forEach((k) => { k.onchange = kindChanged; });
  kindChanged();
  go.disabled = true;
  form.dataset.checking = "yes";
  dialog.returnValue = "";
  dialog.showModal();
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue !== "ok") return;
    const data = new FormData(form);
    const kind = String(data.get("kind"));
    const body = kind === "live" ? { live: true } : { live: false, mode: kind, balloon: data.get("balloon") === "on" };
    try {
      followBring(await api.bring(host, capsule.name, body), { onEnd });
    } catch (err) {
      await openBring(host, capsule, { onEnd });
      error.textContent = err.message;
    }
  }, { once: true });
  const answer = await ask(host, capsule.name);     // asked again: the list's answer may be 30 s old
  checks.set(`${host}/${capsule.name}`, { at: Date.now(), answer, asking: false });
  delete form.dataset.checking;
  showLiveRefusals(form, answer.live_refusals || []);
  go.disabled = Boolean(answer.refused);
  if (answer.refused) error.textContent = answer.refused.detail;
}
