// The guest's screen follows the console panel's size: on connecting, and whenever the panel changes size (the
// window resized, full screen), the page asks the agent to set the guest's resolution to the panel's size in CSS
// pixels (PUT /api/capsules/NAME/screen-size: the guest's X server changes its mode through the guest agent; QEMU's
// VNC server then sends noVNC the new size). Where that fails (a guest without an X session, such as a text
// console; a peer's capsule) the screen is only scaled to fit, as noVNC's scaleViewport does anyway.
//
//   fitScreen(name, panel)   start following panel (an element) for this host's capsule `name`; returns stop()
// #console carries data-fit: "guest" (its resolution follows), "scale" (scaled only), "" (not yet known).

import * as api from "./api.js";

const $ = (id) => document.getElementById(id);
const SETTLE_MS = 400;      // a window being dragged asks once it settles

export function fitScreen(name, panel) {
  let timer = null;
  let stopped = false;
  let asked = "";
  $("console").dataset.fit = "";

  async function ask() {
    const width = Math.floor(panel.clientWidth);
    const height = Math.floor(panel.clientHeight);
    const want = `${width}x${height}`;
    if (stopped || !width || !height || want === asked) return;
    asked = want;
    try {
      await api.setScreenSize(name, width, height);
      if (!stopped) $("console").dataset.fit = "guest";
    } catch {
      if (!stopped) $("console").dataset.fit = "scale";
      stop();        // no X session to resize: scaled to fit from now on
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
