"""The disk server's chain spec: round trips through JSON, relative paths, and clear refusals."""

from __future__ import annotations

import json

import pytest

from diskserver.chain import ChainSpec, LayerSpec, ReadaheadSpec, RemoteSpec, RetrySpec
from diskserver.errors import SpecError

pytestmark = pytest.mark.unit


# -- the spec -------------------------------------------------------------------------------------------------


def test_spec_round_trips_and_resolves_relative_paths(tmp_path):
    layer = LayerSpec(id="a" * 64, manifest_path="m/a.manifest",
                      remote=RemoteSpec("http://127.0.0.1:1", "tok"))
    top = LayerSpec(id="b" * 64, manifest_path="m/b.manifest", local_path="top.qcow2")
    spec = ChainSpec(layers=(layer, top), shadow_dir="shadows", readahead=ReadaheadSpec(0, 64),
                     retry=RetrySpec(seconds=3.0), hash_cache="hc.bin")
    again = ChainSpec.from_dict(json.loads(spec.to_json()))
    assert again == spec
    spec.save(tmp_path / "spec.json")
    loaded = ChainSpec.load(tmp_path / "spec.json")
    assert loaded.layers[0].manifest_path == str(tmp_path / "m/a.manifest")
    assert loaded.layers[0].remote.token_file == str(tmp_path / "tok")
    assert loaded.layers[1].local_path == str(tmp_path / "top.qcow2")
    assert loaded.shadow_dir == str(tmp_path / "shadows")
    assert loaded.readahead.max_blocks == 64 and loaded.retry.seconds == 3.0
    assert loaded.resolved_stats_path == tmp_path / "shadows" / f"chain-{'b' * 16}.stats.json"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(layers=[]), "at least one layer"),
    (lambda d: d["layers"][0].update(id="xyz"), "64-hex-digit"),
    (lambda d: d["layers"][0].update(local_path="/x.qcow2"), "exactly one of local_path and remote"),
    (lambda d: d["layers"][0].update(remote=None), "exactly one of local_path and remote"),
    (lambda d: d["layers"][0]["remote"].update(url="ftp://x"), "http://"),
    (lambda d: d.update(surprise=1), "unknown chain spec field"),
    (lambda d: d.update(readahead={"min_blocks": 9, "max_blocks": 1}), "min_blocks"),
    (lambda d: d.update(version=7), "version"),
    (lambda d: d.update(size=-5), "size"),
    (lambda d: d.update(name="../evil"), "name"),
    # JSON has no Infinity: a spec saved with it could not be read back (CAPSULE_SOURCE_RETRY_SECONDS=inf)
    (lambda d: d.update(retry={"seconds": float("inf")}), "retry.seconds must be a non-negative finite number"),
    (lambda d: d.update(retry={"max_delay": float("nan")}), "retry.max_delay must be a non-negative finite"),
])
def test_bad_specs_are_refused_clearly(mutate, message):
    d = {"layers": [{"id": "a" * 64, "manifest_path": "/m", "local_path": None,
                     "remote": {"url": "http://h:1", "token_file": "/t"}}], "shadow_dir": "/s"}
    mutate(d)
    with pytest.raises(SpecError, match=message):
        ChainSpec.from_dict(d)
