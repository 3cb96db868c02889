// The guest's screen follows the console panel's size: on connecting, and whenever the panel changes size (the
// window resized, full screen), the page asks the agent to set the guest's resolution to the panel's size in CSS
// pixels (PUT /api/capsules/NAME/screen-size: the guest's X server changes its mode through the guest agent; QEMU's
// VNC server then sends noVNC the new size; a peer's capsule's through this agent, PUT
// /api/hosts/HOST/capsules/NAME/screen-size, as its console is relayed). Where that fails the screen is only scaled to fit, as noVNC's
// scaleViewport does anyway: a guest whose X session is still starting is asked again every RETRY_MS, up to
// RETRIES times (a desktop opened as it boots gets its size once it can); a guest without an X session (a text
// console) stays scaled.
//
//   fitScreen(host, name, panel)   start following panel (an element) for capsule `name` of peer `host` (null:
//                                  this host's); returns stop()
// #console carries data-fit: "guest" (its resolution follows), "scale" (scaled only), "" (not yet known).

import * as api from "./api.js";

const $ = (id) => document.getElementById(id);
const SETTLE_MS = 400;      // a window being dragged asks once it settles
const RETRY_MS = 5000;      // a refused size is asked again this much later
const RETRIES = 12;         // … this many times (a minute: a booting desktop's X session is up by then)

export function fitScreen(host, name, panel) {
  let timer = null;
  let stopped = false;
  let asked = "";
  let retries = RETRIES;
  $("console").dataset.fit = "";

  async function ask() {
    const width = Math.floor(panel.clientWidth);
    const height = Math.floor(panel.clientHeight);
    const want = `${width}x${height}`;
    if (stopped || !width || !height || want === asked) return;
    asked = want;
    try {
      await (host ? api.setPeerScreenSize(host, name, width, height) : api.setScreenSize(name, width, height));
      if (!stopped) $("console").dataset.fit = "guest";
    } catch {
      if (stopped) return;
      $("console").dataset.fit = "scale";
      asked = "";                                   // scaled to fit meanwhile; asked again later
      if (retries-- > 0) timer = setTimeout(ask, RETRY_MS);
      else stop();                                  // no X session to resize: scaled to fit from now on
    }
  }

  const observer = new ResizeObserver(() => {
    clearTimeout(timer);
    timer = setTimeout(ask, SETTLE_MS);
  });
  observer.observe(panel);

  function stop() {
    stopped = true;
    clearTimeout(timer);
    observer.disconnect();
  }

  ask();
  return stop;
}
