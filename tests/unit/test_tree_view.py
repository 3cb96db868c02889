"""The hierarchy as a graph (``views.tree_graph``): what ``capsule tree --json`` prints and ``GET /api/tree``
answers, built from catalogue rows alone."""

from __future__ import annotations

import pytest

from capsule.agent.apimodels import TreeOut
from capsule.store.catalogue import CapsuleRow, FileRow, ImageRow, InstanceRow, LayerRow, VersionRow
from capsule.views import TreeParts, tree_graph

pytestmark = pytest.mark.unit


def _layer(lid: str, parent: str | None, created: float, size: int = 4096) -> LayerRow:
    return LayerRow(id=lid, parent=parent, virtual_size=1 << 30, file_size=size + 512, stored_bytes=size,
                    blocks=size // 4096, created=created)


def _version(capsule: str, number: int, chains: list[list[str]], memory: str | None = None,
             parent: tuple[str, int] | None = None) -> VersionRow:
    return VersionRow(capsule=capsule, number=number, parent_capsule=parent[0] if parent else None,
                      parent_version=parent[1] if parent else None, memory=memory, chains=chains,
                      config={"kernel": "k", "initrd": "i"}, note="", created=float(number))


def _parts(**over) -> TreeParts:
    """Fig. 1 in small: image root R; desk@1 on R; desk@2 (with memory M) on A (child of R); kid derived from
    desk@2 with its own @2 on B (child of A), running; a second disk for desk@2 on root S; an orphan layer O
    whose parent the catalogue no longer has; a remote layer X (child of A) that kid@3 builds on."""
    layers = [_layer("B", "A", 3.0), _layer("R", None, 1.0, 1 << 20), _layer("A", "R", 2.0), _layer("S", None, 1.5),
              _layer("O", "gone", 0.5)]
    versions = [_version("desk", 1, [["R"]]),
                _version("desk", 2, [["R", "A"], ["S"]], memory="M"),
                _version("kid", 1, [["R", "A"], ["S"]], memory="M", parent=("desk", 2)),
                _version("kid", 2, [["R", "A", "B"], ["S"]], memory="N", parent=("desk", 2)),
                _version("kid", 3, [["R", "A", "X"], ["S"]], parent=("desk", 2))]
    parts = TreeParts(
        store_id="store-1", layers=layers,
        images=[ImageRow("tiny", "tiny", "R", "k", "i", "", "", {}, 0.0)],
        capsules=[CapsuleRow("desk", "u1", "tiny", None, None, 0.0), CapsuleRow("kid", "u2", "tiny", "desk", 2, 0.0)],
        versions=versions,
        instances=[InstanceRow("kid", 2, "capsule-store-1-kid", ["leaf-1"], [["R", "A", "B"], ["S"]], "tcg", "/x")],
        files={"M": FileRow("M", "memory", 256 << 20, 30 << 20, 20 << 20, 0.0),
               "N": FileRow("N", "memory", 256 << 20, 40 << 20, 25 << 20, 0.0)},
        states={"desk": "suspended", "kid": "running"},
        remote={"X": {"id": "X", "parent": "A", "url": "http://work.example:7171", "added": 4.0}})
    for k, v in over.items():
        setattr(parts, k, v)
    return parts


def test_layers_come_parents_first_with_depth_images_and_the_versions_ending_there():
    g = tree_graph(_parts())
    order = [x["id"] for x in g["layers"]]
    # roots oldest first (O, R, S), each followed by its subtree, siblings oldest first (B before X)
    assert order == ["O", "R", "A", "B", "X", "S"]
    by = {x["id"]: x for x in g["layers"]}
    assert {k: by[k]["parent"] for k in order} == {"O": None, "R": None, "A": "R", "B": "A", "X": "A", "S": None}
    assert [by[k]["depth"] for k in order] == [0, 0, 1, 2, 2, 0]
    assert by["R"]["images"] == ["tiny"] and by["A"]["images"] == []
    assert by["R"]["versions"] == ["desk@1"]
    assert by["A"]["versions"] == ["desk@2", "kid@1"]
    assert by["S"]["versions"] == ["desk@2", "kid@1", "kid@2", "kid@3"]
    assert by["R"]["stored_bytes"] == 1 << 20 and by["R"]["remote"] is None
    assert by["X"]["remote"] == {"url": "http://work.example:7171"} and by["X"]["stored_bytes"] is None


def test_versions_instances_and_memory_images():
    g = tree_graph(_parts())
    v = {x["ref"]: x for x in g["versions"]}
    assert v["desk@2"]["tops"] == ["A", "S"] and v["desk@2"]["chains"] == [["R", "A"], ["S"]]
    assert v["kid@2"]["parent"] == "desk@2" and v["desk@1"]["parent"] is None
    assert [r for r, x in v.items() if x["running"]] == ["kid@2"]
    assert (v["desk@1"]["active"], v["desk@2"]["active"], v["desk@2"]["memory"]) == (False, True, "M")
    assert g["instances"] == [{"capsule": "kid", "version": 2, "ref": "kid@2", "domain": "capsule-store-1-kid",
                               "state": "running", "tops": ["B", "S"], "started": g["instances"][0]["started"]}]
    mem = {m["id"]: m for m in g["memory_images"]}
    assert mem["M"]["versions"] == ["desk@2", "kid@1"] and mem["M"]["allocated"] == 30 << 20
    assert mem["N"]["versions"] == ["kid@2"]
    assert {c["name"]: (c["state"], c["parent"]) for c in g["capsules"]} == {
        "desk": ("suspended", None), "kid": ("running", "desk@2")}
    assert g["images"] == [{"name": "tiny", "kind": "tiny", "root_layer": "R"}]
    TreeOut.model_validate(g)          # what the API documents is what the builder makes


def test_the_graph_follows_the_catalogue():
    """Nothing running: no instance, no version marked running; a removed version leaves its layer bare."""
    p = _parts(instances=[], versions=_parts().versions[:2], remote={})
    g = tree_graph(p)
    assert g["instances"] == [] and not any(v["running"] for v in g["versions"])
    by = {x["id"]: x for x in g["layers"]}
    assert "X" not in by and by["B"]["versions"] == [] and by["A"]["versions"] == ["desk@2"]
    assert [m["id"] for m in g["memory_images"]] == ["M"]


def test_an_empty_store():
    g = tree_graph(_parts(layers=[], images=[], capsules=[], versions=[], instances=[], files={}, states={},
                          remote={}))
    assert g == {"store_id": "store-1", "layers": [], "images": [], "capsules": [], "versions": [],
                 "memory_images": [], "instances": []}
