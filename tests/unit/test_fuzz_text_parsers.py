"""Fuzzing the text and JSON parsers that take what a user, a peer or a file gives: version records
(capsule/transfer/records.py, from a peer), the backup calendar and retention rules (capsule/backup/), the
disk server's chain spec (diskserver/chain/spec.py) and pod names and addresses (pods/names.py).
Valid inputs round-trip; anything else gives the parser's typed error, nothing else."""

from __future__ import annotations

import copy
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.backup import calendar
from capsule.backup.calendar import CalendarError
from capsule.backup.retention import Policy, PolicyError, Snapshot, apply, parse_duration
from capsule.errors import InvalidName
from capsule.transfer.records import validate
from diskserver.chain import ChainSpec
from diskserver.errors import SpecError
from pods.names import PodError, check_name, parse_ip
from tests.helpers.fuzzing import MARKS, deep_json, fuzz, json_values

pytestmark = MARKS

hexid = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)


# -- version records -------------------------------------------------------------------------------------

records = st.fixed_dictionaries({
    "capsule": names, "number": st.integers(1, 10**9 - 1),
    "chains": st.lists(st.lists(hexid, min_size=1, max_size=3), min_size=1, max_size=3),
    "memory": st.none() | hexid,
    "config": st.fixed_dictionaries({"memory_mib": st.integers(64, 4096), "vcpus": st.integers(1, 8),
                                     "kernel": hexid, "initrd": hexid, "cmdline": st.text(max_size=20),
                                     "marker": st.text(max_size=10)}),
}, optional={"uuid": st.uuids().map(str), "image": names, "parent_capsule": names,
             "parent_version": st.integers(1, 10**9 - 1)})


@fuzz
@given(records)
def test_valid_version_records_pass_unchanged(record):
    sent = json.loads(json.dumps(record))
    assert validate(sent) == record


@st.composite
def mangled_records(draw: st.DrawFn) -> object:
    record = copy.deepcopy(draw(records))
    for _ in range(draw(st.integers(1, 3))):
        target = record
        path = draw(st.sampled_from([("capsule",), ("number",), ("chains",), ("memory",), ("config",),
                                     ("uuid",), ("parent_version",), ("config", "kernel"), ("config", "vcpus"),
                                     ("config", "image"), ("config", "balloon"), ("chains", 0), ("new",)]))
        for key in path[:-1]:  # an earlier change may have replaced or dropped the container
            target = target.get(key) if isinstance(target, dict) else None
        if isinstance(target, list):
            if target:
                target[0] = draw(json_values)
        elif not isinstance(target, dict):
            continue
        elif draw(st.booleans()):
            target[path[-1]] = draw(json_values)
        else:
            target.pop(path[-1], None)
    return record


@fuzz
@given(mangled_records() | json_values)
def test_mangled_version_records_give_invalid_name(record):
    try:
        out = validate(record)
    except InvalidName:
        return
    assert out is record and validate(json.loads(json.dumps(out))) == out


# -- calendar events and retention rules --------------------------------------------------------------------

_field = st.one_of(st.just("*"), st.integers(0, 70).map(str), st.builds("{}..{}".format, st.integers(0, 30),
                   st.integers(0, 60)), st.builds("{}/{}".format, st.integers(0, 59), st.integers(0, 99)))
calendar_texts = st.one_of(
    st.sampled_from(["daily", "weekly", "monthly", "yearly", "hourly", "minutely", "quarterly", "semiannually"]),
    st.builds(lambda wd, y, mo, d, h, mi, s, z: " ".join(x for x in (
        wd, f"{y}-{mo}-{d}" if d else "", f"{h}:{mi}" + (f":{s}" if s else ""), z) if x),
        st.sampled_from(["", "Mon", "mon..fri", "Sat,Sun", "Tue..Mon", "Fri,"]), _field, _field,
        st.sampled_from(["", "1", "*", "~1", "28..31", "1,15", "~7/1", "0"]), _field, _field,
        st.sampled_from(["", "0", "*", "30/5", "1.5"]), st.sampled_from(["", "UTC", "Europe/Berlin", "Mars/Base"])),
    st.text(max_size=40),
)


@fuzz
@given(calendar_texts)
@example("*-*-" + "9" * 200)
@example("9999999999999999999-01-01")
@example("*-02-30 00:00")
def test_calendar_events_parse_round_trip_or_give_calendar_errors(text):
    try:
        event = calendar.parse(text)
    except CalendarError:
        return
    again = calendar.parse(event.normalized())
    assert again.normalized() == event.normalized()
    when = event.next_after(datetime(2026, 1, 31, 12, 0, tzinfo=UTC))
    assert when is None or when > datetime(2026, 1, 31, 12, 0, tzinfo=UTC)


policy_texts = st.one_of(
    st.lists(st.builds("{}={}".format, st.sampled_from(["last", "hourly", "daily", "weekly", "monthly", "yearly",
                                                        "keep-daily", "within", "bogus", ""]),
                       st.integers(0, 200_000).map(str) | st.sampled_from(["1y", "7d", "1m15d", "12h", "9999y",
                                                                           "99999m", "999999d", "-1", "x"])),
             max_size=4).map(",".join),
    st.text(max_size=30),
)


@fuzz
@given(policy_texts)
@example("daily=" + "1" * 5000)  # was ValueError: int() of more than 4300 digits
@example("within=9999y")  # was ValueError out of apply(): a cutoff before year 1
@example("within=999999d")  # was OverflowError out of apply()
def test_retention_policies_parse_round_trip_and_apply_or_give_policy_errors(text):
    try:
        policy = Policy.parse(text)
    except PolicyError:
        return
    assert Policy.from_dict(policy.as_dict()) == policy
    snaps = [Snapshot(n, 1_700_000_000.0 - n * 86_400 * 40) for n in range(1, 6)]
    decisions = apply(snaps, policy, UTC)
    assert len(decisions) == 5 and decisions[0].keep


def test_a_retention_count_of_thousands_of_digits_is_a_policy_error():
    """Regression: ``daily=111…1`` (5000 digits) raised ValueError from int()."""
    with pytest.raises(PolicyError, match="whole number from 0 to"):
        Policy.parse("daily=" + "1" * 5000)


@pytest.mark.parametrize("within", ["9999y", "99999m", "999999d"])
def test_a_keep_within_longer_than_the_calendar_keeps_everything(within):
    """Regression: a cutoff before year 1 raised ValueError / OverflowError out of apply()."""
    snaps = [Snapshot(n, 1_700_000_000.0 - n * 86_400 * 400) for n in range(1, 4)]
    decisions = apply(snaps, Policy(within=within), UTC)
    assert all(d.keep and d.reasons == [f"within {within}"] for d in decisions[1:])
    assert parse_duration(within)


# -- the disk server's chain spec -----------------------------------------------------------------------------

specs = st.builds(
    lambda ids, size, remote: {
        "version": 1, "size": size, "shadow_dir": "shadows",
        "layers": [{"id": i, "manifest_path": f"{i[:8]}.manifest", "local_path": f"{i[:8]}.qcow2"} for i in ids[:-1]]
        + [{"id": ids[-1], "manifest_path": "top.manifest",
            **({"remote": {"url": "https://127.0.0.1:7171", "token_file": "token"}} if remote
               else {"local_path": "top.qcow2"})}]},
    st.lists(hexid, min_size=1, max_size=3, unique=True), st.integers(1, 2**40), st.booleans())


@fuzz
@given(specs)
def test_chain_specs_round_trip(data):
    spec = ChainSpec.from_dict(data)
    assert ChainSpec.from_dict(json.loads(spec.to_json())) == spec


@st.composite
def mangled_specs(draw: st.DrawFn) -> object:
    data = copy.deepcopy(draw(specs))
    key = draw(st.sampled_from(["size", "layers", "shadow_dir", "readahead", "retry", "compress_level", "name",
                                "prefetch", "stats_interval", "version", "bogus"]))
    if draw(st.booleans()):
        data[key] = draw(json_values)
    else:
        layer = draw(st.sampled_from(data["layers"]))
        layer[draw(st.sampled_from(["id", "manifest_path", "local_path", "remote", "extra"]))] = draw(json_values)
    return data


@fuzz
@given(mangled_specs() | json_values)
def test_mangled_chain_specs_give_spec_errors(data):
    try:
        spec = ChainSpec.from_dict(data)
    except SpecError:
        return
    assert ChainSpec.from_dict(json.loads(spec.to_json())) == spec


@fuzz
@given(st.binary(max_size=200) | specs.map(lambda d: json.dumps(d).encode()) | st.just(deep_json()))
@example(deep_json())  # was RecursionError out of ChainSpec.load
def test_chain_spec_files_load_or_give_spec_errors(raw):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chain.json"
        path.write_bytes(raw)
        try:
            ChainSpec.load(path)
        except SpecError as exc:
            assert str(path) in str(exc)


# -- pod names and addresses ------------------------------------------------------------------------------------

@fuzz
@given(st.from_regex(r"[a-z][a-z0-9-]{0,30}", fullmatch=True) | st.text(max_size=40))
def test_pod_names_are_checked_or_give_pod_errors(name):
    try:
        assert check_name(name) == name
    except PodError as exc:
        assert exc.kind == "invalid_name"


@fuzz
@given(st.builds("{}.{}.{}.{}/{}".format, *[st.integers(0, 300)] * 4, st.integers(0, 40))
       | st.builds("{}.{}.{}.{}".format, *[st.integers(0, 255)] * 4) | st.text(max_size=30))
@example("1.2.3.4/" + "9" * 5000)
def test_pod_addresses_round_trip_or_give_pod_errors(text):
    try:
        iface = parse_ip(text)
    except PodError:
        return
    assert parse_ip(str(iface)) == iface and iface.network.prefixlen <= 30
