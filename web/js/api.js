// The dashboard's only way to the host: the JSON API under /api/ (the same calls a script makes).
// Every state-changing call carries the session's CSRF token in the X-CSRF-Token header.

let csrf = null;

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && csrf) headers["X-CSRF-Token"] = csrf;
  let resp;
  try {
    resp = await fetch(`/api/${path}`, {
      method, headers, credentials: "same-origin", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw new ApiError(0, `cannot reach this host's agent (${err.message})`);
  }
  if (resp.status === 204) return null;
  let data = null;
  try {
    data = await resp.json();
  } catch {
    data = null;
  }
  if (!resp.ok) throw new ApiError(resp.status, describe(resp.status, data));
  return data;
}

function describe(status, data) {
  const detail = data && data.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {  // a request the API's schema refused
    return detail.map((d) => `${(d.loc || []).slice(1).join(".") || "request"}: ${d.msg}`).join("; ");
  }
  return `the host answered ${status}`;
}

// body: {user, password}, or {token} (the host's token, while the host has no admin user)
export async function signIn(body) {
  const s = await call("POST", "session", body);
  csrf = s.csrf;
  return s;
}

export async function currentSession() {
  const s = await call("GET", "session");
  csrf = s.csrf;
  return s;
}

export async function signOut() {
  try {
    await call("DELETE", "session");
  } finally {
    csrf = null;
  }
}

export const capsules = () => call("GET", "capsules");
export const peers = () => call("GET", "hosts");
export const tree = () => call("GET", "tree");
export const peerTree = (host) => call("GET", `hosts/${encodeURIComponent(host)}/tree`);
export const action = (name, verb, body = {}) => call("POST", `capsules/${encodeURIComponent(name)}/${verb}`, body);
export const consoleTicket = (name, kind = "screen") =>
  call("POST", `capsules/${encodeURIComponent(name)}/console-ticket?kind=${encodeURIComponent(kind)}`, {});
export const peerConsoleTicket = (host, name, kind = "screen") =>
  call("POST", `hosts/${encodeURIComponent(host)}/capsules/${encodeURIComponent(name)}/console-ticket` +
    `?kind=${encodeURIComponent(kind)}`, {});
// the guest's clipboard, through its guest agent (capsule/console/clipboard.py): {text, bytes, max_bytes}
export const clipboard = (name) => call("GET", `capsules/${encodeURIComponent(name)}/clipboard`);
export const setClipboard = (name, text) => call("PUT", `capsules/${encodeURIComponent(name)}/clipboard`, { text });
// a peer's capsule's, asked of the peer through this agent (capsule/console/peerclip.py): the same fields
export const peerClipboard = (host, name) =>
  call("GET", `hosts/${encodeURIComponent(host)}/capsules/${encodeURIComponent(name)}/clipboard`);
export const setPeerClipboard = (host, name, text) =>
  call("PUT", `hosts/${encodeURIComponent(host)}/capsules/${encodeURIComponent(name)}/clipboard`, { text });
// the guest's screen resolution (capsule/console/screensize.py): {width, height} as set
export const setScreenSize = (name, width, height) =>
  call("PUT", `capsules/${encodeURIComponent(name)}/screen-size`, { width, height });
// a peer's capsule's, set by the peer through this agent (capsule/console/peerclip.py)
export const setPeerScreenSize = (host, name, width, height) =>
  call("PUT", `hosts/${encodeURIComponent(host)}/capsules/${encodeURIComponent(name)}/screen-size`, { width, height });

// migrations (capsule/agent/migrations.py); progress streams from /api/migrations/{id}/events (EventSource)
export const migrate = (name, body) => call("POST", `capsules/${encodeURIComponent(name)}/migrate`, body);
export const migration = (id) => call("GET", `migrations/${encodeURIComponent(id)}`);
export const migrateCheck = (name, host) =>
  call("GET", `capsules/${encodeURIComponent(name)}/migrate/check?to=${encodeURIComponent(host)}`);
export const cancelMigration = (id) => call("POST", `migrations/${encodeURIComponent(id)}/cancel`);
// Bring here (capsule/agent/bringapi.py): a peer's capsule migrated to this host, followed through this agent
const peerPath = (host) => `hosts/${encodeURIComponent(host)}`;
export const bringCheck = (host, name) => call("GET", `${peerPath(host)}/capsules/${encodeURIComponent(name)}/bring/check`);
export const bring = (host, name, body) =>
  call("POST", `${peerPath(host)}/capsules/${encodeURIComponent(name)}/bring`, body);
export const peerMigration = (host, id) => call("GET", `${peerPath(host)}/migrations/${encodeURIComponent(id)}`);
export const cancelPeerMigration = (host, id) =>
  call("POST", `${peerPath(host)}/migrations/${encodeURIComponent(id)}/cancel`);

// backups (capsule/agent/backupsapi.py)
export const backups = () => call("GET", "backups");
export const runBackup = (name) => call("POST", `backups/${encodeURIComponent(name)}/run`, {});
export const restoreBackup = (name, body) => call("POST", `backups/${encodeURIComponent(name)}/restore`, body);
export const verifyBackups = () => call("POST", "backups/verify", {});
