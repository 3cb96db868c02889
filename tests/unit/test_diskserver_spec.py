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


# -- a source that is no agent ----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_source_opened_by_a_named_function_round_trips_and_is_opened(tmp_path, monkeypatch):
    """A remote spec with an opener keeps it through JSON (an agent's entry has none), and the chain's source is
    what that function returns, given the URL, the secret file and the retry settings."""
    import sys
    import types

    from diskserver.source import open_source

    remote = RemoteSpec("s3+http://store:8333/bucket/prefix", "secret", opener="fake_blocks.mod:open_it")
    spec = ChainSpec(layers=(LayerSpec(id="a" * 64, manifest_path="a.manifest", remote=remote),),
                     shadow_dir="shadows")
    assert ChainSpec.from_dict(json.loads(spec.to_json())) == spec
    agent = ChainSpec(layers=(LayerSpec(id="a" * 64, manifest_path="m", remote=RemoteSpec("http://h:1", "t")),),
                      shadow_dir="s")
    assert "opener" not in agent.to_dict()["layers"][0]["remote"]

    calls = []
    module = types.ModuleType("fake_blocks.mod")
    module.open_it = lambda url, secret, retry: calls.append((url, secret, retry.seconds)) or "the source"
    monkeypatch.setitem(sys.modules, "fake_blocks", types.ModuleType("fake_blocks"))
    monkeypatch.setitem(sys.modules, "fake_blocks.mod", module)
    assert open_source(remote, RetrySpec(seconds=4.0)) == "the source"
    assert calls == [("s3+http://store:8333/bucket/prefix", "secret", 4.0)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("remote, message", [
    ({"url": "s3://x/b", "token_file": "/t", "opener": "not a name"}, "package.module:function"),
    ({"url": "s3://x/b", "token_file": "/t", "opener": "os:system; rm"}, "package.module:function"),
    ({"url": "s3://x/b", "token_file": "/t", "opener": "m:f", "fingerprint": "SHA256:" + "A" * 43}, "takes none"),
    ({"url": "", "token_file": "/t", "opener": "m:f"}, "url is required"),
])
def test_a_bad_opener_is_refused_clearly(remote, message):
    d = {"layers": [{"id": "a" * 64, "manifest_path": "/m", "remote": remote}], "shadow_dir": "/s"}
    with pytest.raises(SpecError, match=message):
        ChainSpec.from_dict(d)


@pytest.mark.timeout(10)
def test_an_opener_that_cannot_be_loaded_is_a_source_error():
    from diskserver.errors import SourceError
    from diskserver.source import open_source

    with pytest.raises(SourceError, match="cannot be loaded"):
        open_source(RemoteSpec("s3://x/b", "/t", opener="no_such_module_here:f"), RetrySpec())
