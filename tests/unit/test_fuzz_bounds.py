"""Fuzzing every number from the network: the bounds' checker itself (hashcache/bounds.py), the agent's query
parameters through a real app, the dashboard's request models, and the wire decoders that read numbers — a
version record's machine and versions (capsule/transfer/records.py), a LOOKUP reply's header (hashcache/hcp.py), a pull
request's zstd level (capsule/exchange/fleet.py) and JSON itself (hashcache/wirejson.py). Values: NaN, ±inf,
negative, huge integers, bools where a whole number belongs, numeric strings, other JSON. Each is either taken
and within its bounds (an ``int`` for a whole number, a finite ``float`` otherwise) or refused with the typed
error naming the field — never another exception."""

from __future__ import annotations

import json
import math
import uuid

import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from capsule import bounds as capsule_bounds
from capsule.agent import bounded
from capsule.agent.apimodels import DeriveIn, RmIn, StartIn, StopIn
from capsule.agent.app import create_app
from capsule.agent.backupsapi import RestoreIn
from capsule.errors import InvalidName
from capsule.exchange.fleet import pull_level
from capsule.store import Store
from capsule.transfer.records import CONFIG_BOUNDS, validate
from hashcache import bounds as hashcache_bounds
from hashcache import wirejson
from hashcache.blocks import BLOCK_SIZE
from hashcache.bounds import Bound, blocks_in
from hashcache.hcp import ProtocolError, manifest_header
from tests.helpers.fuzzing import EDGE_INTS, MARKS, fuzz, json_values
from tests.helpers.received import record_of

pytestmark = MARKS

TOKEN = "fuzz-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

BOUNDS = [b for module in (capsule_bounds, hashcache_bounds) for b in vars(module).values() if isinstance(b, Bound)]
BOUNDS += [blocks_in(0), blocks_in(1), blocks_in(40 * BLOCK_SIZE + 1), Bound(-5, 5), Bound(0.5, 2.5, integer=False)]

# what a peer or a client can put where a number belongs
edges = st.sampled_from([*EDGE_INTS, *(-i for i in EDGE_INTS), 2**63, 2**64, 10**18, 10**30, 2**200])
numbers = st.one_of(
    st.integers(-(2**80), 2**80), edges, st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e309]),
    st.booleans(), st.integers(-100, 2000), st.floats(-100, 2000),
)
numeric_text = st.one_of(
    numbers.map(str), numbers.map(repr),
    st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "1e309", "1_0", "٣", "0x10", " 7 ", "+5", "-0", "1.",
                     ".5", "1e3", "5e-1", "true", "", "1" * 40, "9" * 5000]),
    st.from_regex(r"[+-]?[0-9]{0,12}(\.[0-9]{0,6})?([eE][+-]?[0-9]{1,3})?", fullmatch=True),
)
values = numbers | numeric_text | json_values


def taken_within(bound: Bound, got: object, given: object) -> None:
    """``got`` is what ``bound`` made of ``given``: the right type, finite, within, and the same number."""
    if bound.integer:
        assert type(got) is int, (given, got)
    else:
        assert type(got) is float and math.isfinite(got), (given, got)
    assert bound.lo <= got <= bound.hi, (bound, given, got)


# -- the checker ------------------------------------------------------------------------------------------

@fuzz
@given(st.sampled_from(BOUNDS), values)
@example(capsule_bounds.VCPUS, True)
@example(capsule_bounds.TIMEOUT, math.nan)
@example(capsule_bounds.MEMORY_MIB, 2**200)
def test_a_value_is_taken_within_its_bound_or_refused_naming_field_value_and_range(bound, value):
    try:
        got = bound.check(value, "the_field", InvalidName)
    except InvalidName as exc:
        assert not bound.contains(value)
        assert str(exc).startswith("the_field: ") and bound.describe() in str(exc), exc
        assert len(str(exc)) < 200, exc               # the value is cut short, however long
        return
    taken_within(bound, got, value)
    assert got == value and not isinstance(value, bool | str)


@fuzz
@given(st.sampled_from(BOUNDS), numeric_text)
def test_text_is_read_as_plain_decimal_within_its_bound_or_refused(bound, text):
    try:
        got = bound.check_text(text, "q", InvalidName)
    except InvalidName as exc:
        assert str(exc).startswith("q: ") and bound.describe() in str(exc), exc
        return
    taken_within(bound, got, text)
    assert text.strip().isascii() and "_" not in text and "n" not in text.lower()   # no nan, inf, 1_0


# -- the agent's query parameters, through a real app ---------------------------------------------------------

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    home = tmp_path_factory.mktemp("agent")
    Store.open(home / "store").close()
    with TestClient(create_app(home / "store", TOKEN)) as client:
        yield client


GHOST = "ab" * 32
# (method, path, query parameter, its bound, the other parameters): every call names a capsule or an object
# that is not here, so a number that is taken leads to a 404 (or a refused body), never to work
QUERIES = [
    ("POST", "/v1/capsules/ghost/start", "timeout", capsule_bounds.TIMEOUT, {}),
    ("POST", "/v1/capsules/ghost/start", "version", capsule_bounds.VERSION, {}),
    ("POST", "/v1/capsules/ghost/activate", "timeout", capsule_bounds.TIMEOUT, {"version": "1"}),
    ("POST", "/v1/capsules/ghost/activate", "version", capsule_bounds.VERSION, {}),
    ("GET", f"/v1/objects/file/{GHOST}/records", "start", hashcache_bounds.OBJECT_BLOCKS, {}),
    ("GET", f"/v1/objects/file/{GHOST}/records", "count", Bound(0, 1 << 20), {}),
    ("GET", f"/v1/objects/file/{GHOST}/records", "hash_len", Bound(8, 32), {}),
    ("POST", f"/v1/objects/file/{GHOST}/read", "level", hashcache_bounds.ZSTD_LEVEL, {}),
    ("POST", f"/v1/recv/file/{GHOST}/begin", "part", Bound(0, 4095), {"parts": "4096"}),
    ("POST", f"/v1/recv/file/{GHOST}/begin", "parts", Bound(1, 4096), {}),
    ("POST", f"/v1/recv/file/{GHOST}/blocks", "seq", hashcache_bounds.OBJECT_BLOCKS, {}),
]


@fuzz
@given(st.sampled_from(QUERIES), numeric_text)
@example(QUERIES[0], "nan")
@example(QUERIES[0], "1e309")
@example(QUERIES[1], "true")
def test_query_numbers_are_taken_within_their_bounds_or_refused_with_400(agent, query, text):
    method, path, name, bound, others = query
    r = agent.request(method, path, params={**others, name: text}, headers=AUTH)
    assert r.status_code < 500, r.text
    body = r.json() if r.status_code >= 400 else {}
    refused = f"query.{name}:" in body.get("detail", "")
    assert refused == (bound.parse(text) is None), (text, r.text)
    if refused:
        assert r.status_code == 400 and body["error"] == "invalid_name" and bound.describe() in body["detail"]


# -- the dashboard's request models ---------------------------------------------------------------------------

MODELS: list[tuple[type[BaseModel], str, Bound]] = [
    (StartIn, "timeout", capsule_bounds.TIMEOUT), (StartIn, "version", capsule_bounds.VERSION),
    (StopIn, "timeout", capsule_bounds.STOP_TIMEOUT), (DeriveIn, "version", capsule_bounds.VERSION),
    (RmIn, "version", capsule_bounds.VERSION), (RestoreIn, "version", capsule_bounds.VERSION),
]


@fuzz
@given(st.sampled_from(MODELS), values)
def test_request_models_take_numbers_within_their_bounds_or_refuse_them(model, value):
    cls, name, bound = model
    body = {name: value} | ({"child": "kid"} if cls is DeriveIn else {})
    try:
        got = getattr(cls.model_validate(body), name)
    except ValidationError as exc:
        assert [e["loc"] for e in exc.errors()] == [(name,)], exc
        assert exc.errors()[0]["type"] == bounded.ERROR_TYPE and bound.describe() in str(exc), exc
        assert not bound.contains(value)
        return
    if value is None:      # an optional version left out
        assert got is None and name == "version" and cls is not RestoreIn
        return
    taken_within(bound, got, value)
    assert got == value and bound.contains(value)


# -- the wire decoders ----------------------------------------------------------------------------------------

def a_record() -> dict:
    ids = [uuid.uuid4().hex * 2 for _ in range(3)]
    return record_of("desk", 1, [ids[0]], ids[1], ids[2])


RECORD_NUMBERS = [("config", "memory_mib"), ("config", "vcpus"), (None, "number"), (None, "parent_version"),
                  (None, "created")]
RECORD_BOUNDS = {"memory_mib": CONFIG_BOUNDS["memory_mib"], "vcpus": CONFIG_BOUNDS["vcpus"],
                 "number": capsule_bounds.VERSION, "parent_version": capsule_bounds.VERSION,
                 "created": capsule_bounds.CREATED}


@fuzz
@given(st.sampled_from(RECORD_NUMBERS), values)
@example(("config", "memory_mib"), True)
@example(("config", "vcpus"), 10**12)
def test_a_version_records_numbers_are_taken_within_their_bounds_or_refused(where, value):
    part, key = where
    record = a_record()
    (record[part] if part else record)[key] = value
    bound = RECORD_BOUNDS[key]
    try:
        got = validate(record)
    except InvalidName as exc:
        optional = key in ("parent_version", "created") and value is None
        assert not optional and not bound.contains(value), exc
        return
    taken = (got[part] if part else got)[key]
    if key in ("parent_version", "created") and taken is None:
        return
    taken_within(bound, bound.check(taken, key), taken)


@fuzz
@given(values, values)
@example(40 * BLOCK_SIZE, 10**18)
@example(True, True)
@example(2**50, 1)
def test_a_lookup_headers_size_and_count_are_within_bounds_or_a_protocol_error(size, count):
    head = {"kind": "layer", "algorithm": "blake3", "block_size": BLOCK_SIZE, "size": size, "parent": None,
            "count": count, "digest": "ab" * 32}
    try:
        clean = manifest_header(head)
    except ProtocolError as exc:
        assert "manifest" in str(exc)
        return
    taken_within(hashcache_bounds.OBJECT_SIZE, clean["size"], size)
    taken_within(blocks_in(clean["size"]), clean["count"], count)


@fuzz
@given(values)
def test_a_pull_requests_zstd_level_is_within_bounds_or_refused(level):
    try:
        got = pull_level({"zstd_level": level})
    except InvalidName as exc:
        assert str(exc).startswith("zstd_level: ")
        return
    taken_within(hashcache_bounds.ZSTD_LEVEL, got, level)


number_tokens = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e309", "-1e999", "1e308", "0", "-0.0", "true",
                                 "12345678901234567890123", "1.5", "4" * 5000]) | numbers.map(
    lambda v: json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v))


@fuzz
@given(st.lists(number_tokens, max_size=5))
def test_json_from_outside_carries_only_finite_numbers(tokens):
    text = '{"n": [' + ", ".join(tokens) + "]}"
    try:
        got = wirejson.loads(text)
    except ValueError:
        return
    assert all(not isinstance(v, float) or math.isfinite(v) for v in got["n"]), got
