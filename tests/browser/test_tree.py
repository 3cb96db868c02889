"""The hierarchy drawn as a picture in a real browser (Debian's chromium driven by Playwright): a capsule and
a child derived from it share their layer; a running instance is marked; a suspend and a start from the page
change the picture (a new layer and version; an instance); a click on a version highlights the layers it
reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from capsule import capsules, lifecycle, views
from tests.browser.test_dashboard import SCREENSHOTS, browser  # noqa: F401 - fixture
from tests.helpers.guest import write_blocks

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

# what the picture holds: its boxes and its lines, by their data attributes
PICTURE = """() => {
  const svg = document.querySelector('#tree-view svg');
  if (!svg) return null;
  return {
    nodes: [...svg.querySelectorAll('[data-node]')].map((n) => n.dataset.node).sort(),
    edges: [...svg.querySelectorAll('[data-from]')]
      .map((e) => `${e.dataset.from} > ${e.dataset.to} ${e.dataset.kind}`).sort(),
    running: [...svg.querySelectorAll('[data-running=yes]')].map((n) => n.dataset.node),
    selected: [...svg.querySelectorAll('[data-selected=yes]')]
      .map((n) => n.dataset.node || `${n.dataset.from} > ${n.dataset.to}`).sort(),
  };
}"""


def _picture(page) -> dict | None:
    return page.evaluate(PICTURE)


def _expected(store) -> tuple[list[str], list[str]]:
    """The boxes and lines the picture must have, from the store's own graph (nodes: layers, versions,
    instances; lines: parent layer > layer, top layer > version, version > instance)."""
    g = views.tree_dict(store)
    nodes = [f"layer:{x['id']}" for x in g["layers"]] + [f"version:{v['ref']}" for v in g["versions"]]
    nodes += [f"instance:{i['ref']}" for i in g["instances"]]
    edges = [f"layer:{x['parent']} > layer:{x['id']} parent" for x in g["layers"] if x["parent"]]
    edges += [f"layer:{t} > version:{v['ref']} top" for v in g["versions"] for t in v["tops"]]
    edges += [f"version:{i['ref']} > instance:{i['ref']} runs" for i in g["instances"]]
    return sorted(nodes), sorted(edges)


def test_the_tree_is_a_picture_that_follows_the_store(two_hosts, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, _b, agent_a, _agent_b = two_hosts
    capsules.create(a, "desk", "tiny", memory="256M")
    capsules.derive(a, "desk", "kid")
    lifecycle.start(a, "desk")
    write_blocks(a, "desk", 100, 8)      # so that its suspend seals a layer of its own
    root = a.catalogue.image("tiny").root_layer

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#tree")).to_be_visible()
    svg = page.locator("#tree-view svg")
    expect(svg).to_have_attribute("data-store", a.id)

    # the image's root layer, both versions on it, desk's running instance under desk@1
    pic = _picture(page)
    assert pic["nodes"] == sorted([f"layer:{root}", "version:desk@1", "version:kid@1", "instance:desk@1"])
    assert pic["edges"] == sorted([f"layer:{root} > version:desk@1 top", f"layer:{root} > version:kid@1 top",
                                   "version:desk@1 > instance:desk@1 runs"])
    assert (pic["nodes"], pic["edges"]) == _expected(a)
    assert pic["running"] == ["version:desk@1"]
    expect(page.locator(f'[data-node="layer:{root}"]')).to_contain_text("image tiny")

    # an action from the page: suspend adds desk's own layer (on the root) and desk@2 on it, with memory;
    # the instance is gone; kid@1 stays on the root layer
    row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
    row.locator('button[data-action="suspend"]').click()
    expect(page.locator('[data-node="version:desk@2"]')).to_be_visible(timeout=120_000)
    expect(page.locator('[data-node="instance:desk@1"]')).to_have_count(0, timeout=10_000)
    (top,) = a.catalogue.latest_version("desk").chains[0][-1:]
    assert top != root
    pic = _picture(page)
    assert (pic["nodes"], pic["edges"]) == _expected(a)
    assert f"layer:{root} > layer:{top} parent" in pic["edges"]
    assert f"layer:{top} > version:desk@2 top" in pic["edges"]
    assert pic["running"] == []
    expect(page.locator('[data-node="version:desk@2"]')).to_have_attribute("data-active", "yes")
    expect(page.locator('[data-node="version:desk@2"]')).to_contain_text("memory")

    # another action: start kid from the page; its instance appears under kid@1, marked running
    page.locator('section[data-host="local"] tr[data-capsule="kid"] button[data-action="start"]').click()
    expect(page.locator('[data-node="instance:kid@1"]')).to_be_visible(timeout=120_000)
    expect(page.locator('[data-node="version:kid@1"]')).to_have_attribute("data-running", "yes")
    pic = _picture(page)
    assert (pic["nodes"], pic["edges"]) == _expected(a)
    assert "version:kid@1 > instance:kid@1 runs" in pic["edges"] and pic["running"] == ["version:kid@1"]

    # a click on desk@2 highlights its chain: root, its layer, the line between them and the one to desk@2
    page.locator('[data-node="version:desk@2"]').click()
    expect(svg).to_have_attribute("data-selected", "desk@2")
    assert _picture(page)["selected"] == sorted([f"layer:{root}", f"layer:{top}", "version:desk@2",
                                                 f"layer:{root} > layer:{top}", f"layer:{top} > version:desk@2"])
    expect(page.locator("#tree-selection")).to_contain_text("desk@2")
    expect(page.locator("#tree-selection")).to_contain_text(f"{root[:10]} → {top[:10]}")
    shot = tmp_path / "tree.png"
    page.locator("#tree").screenshot(path=str(shot))
    if SCREENSHOTS:
        shutil.copyfile(shot, Path(SCREENSHOTS) / "tree.png")
    # kid@1 reads the root only; the selection survives a redraw (a derive elsewhere changes the picture)
    page.locator('[data-node="version:kid@1"]').click()
    expect(svg).to_have_attribute("data-selected", "kid@1")
    assert _picture(page)["selected"] == sorted([f"layer:{root}", "version:kid@1", "instance:kid@1",
                                                 f"layer:{root} > version:kid@1", "version:kid@1 > instance:kid@1"])
    capsules.derive(a, "desk", "grandkid")
    expect(page.locator('[data-node="version:grandkid@1"]')).to_be_visible(timeout=15_000)
    expect(svg).to_have_attribute("data-selected", "kid@1")
    assert f"layer:{top} > version:grandkid@1 top" in _picture(page)["edges"]
    # a click on the background clears it
    svg.click(position={"x": 4, "y": 4})
    expect(svg).to_have_attribute("data-selected", "")
