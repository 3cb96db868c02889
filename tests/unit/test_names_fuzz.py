"""Property tests for every name and id check: what is accepted matches the documented
alphabet exactly, and near-misses (a trailing newline, a NUL, a slash, '..', another
script's lookalike letters and digits, a leading '-', one character too many) are
refused with InvalidName, never another exception."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from capsule.agent.serve import parse_listen
from capsule.errors import InvalidName
from capsule.names import VersionRef, check_host, check_name, check_object_id, check_uuid, parse_ref
from capsule.transfer.records import validate
from capsule.units import parse_size
from diskserver.chain import ChainSpec, LayerSpec
from diskserver.errors import SpecError
from hashcache.errors import ManifestError
from hashcache.manifest import ALGORITHM, KIND_LAYER, Manifest

pytestmark = pytest.mark.unit

# No example database on disk, no wall-clock deadline (the machine is shared and slow at times).
fuzz = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# The documented alphabets, written independently of capsule/names.py.
NAME_DOC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HEX_DOC = set("0123456789abcdef")

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True).filter(lambda s: ".." not in s)
object_ids = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
versions = st.integers(min_value=1, max_value=10**9 - 1)

# Characters that must never pass, each a way a name could smuggle something in.
BAD_CHARS = [
    "\n", "\r", "\0", "\t", " ", "/", "\\", "@", ":", "%", "\x7f",
    "\u0430",  # Cyrillic a, looks like 'a'
    "\u0435",  # Cyrillic e
    "\u043e",  # Cyrillic o
    "\uff10",  # fullwidth 0
    "\u0661",  # Arabic-Indic 1 (str.isdigit() is true for it)
    "\u00b2",  # superscript 2 (isdigit() true, int() fails)
    "\u2010",  # hyphen
    "\u2024",  # one dot leader, looks like '.'
    "\uff0e",  # fullwidth full stop
    "\u200b",  # zero-width space
    "\u00e9",  # e acute
    "\u212a",  # Kelvin sign, lowercases to 'k'
]
bad_chars = st.sampled_from(BAD_CHARS)


def insert(s: str, pos: int, c: str) -> str:
    pos = min(pos, len(s))
    return s[:pos] + c + s[pos:]


# -- names ------------------------------------------------------------------------------------------


@fuzz
@given(st.text(max_size=80))
def test_accepted_names_match_the_documented_alphabet(text):
    try:
        check_name(text)
    except InvalidName:
        assert not (NAME_DOC.fullmatch(text) and len(text) <= 63 and ".." not in text)
        return
    assert NAME_DOC.fullmatch(text) and 1 <= len(text) <= 63 and ".." not in text
    assert text.isascii() and "\n" not in text


@fuzz
@given(names)
def test_every_name_in_the_alphabet_is_accepted(name):
    assert check_name(name) == name
    assert parse_ref(name) == VersionRef(name)


@fuzz
@given(names, st.integers(min_value=0, max_value=80), bad_chars)
def test_a_bad_character_anywhere_is_refused(name, pos, c):
    with pytest.raises(InvalidName):
        check_name(insert(name, pos, c))


@pytest.mark.parametrize("suffix", ["\n", "\r\n", "\r", "\0"])
def test_trailing_newline_or_nul_is_refused(suffix):
    # the reported defect: re.match with '$' let "demo\n" through
    for check in (check_name, lambda s: check_name(s, "image"), parse_ref):
        with pytest.raises(InvalidName):
            check("demo" + suffix)
    with pytest.raises(InvalidName):
        parse_ref("demo@3" + suffix)
    with pytest.raises(InvalidName):
        check_object_id("a" * 64 + suffix)
    with pytest.raises(InvalidName):
        check_uuid("123e4567-e89b-12d3-a456-426614174000" + suffix)


@fuzz
@given(names, st.sampled_from(["-", ".", "_"]))
def test_leading_punctuation_is_refused(name, c):
    # '_' is allowed inside a name, but no name starts with punctuation
    with pytest.raises(InvalidName):
        check_name(c + name[:62])


@fuzz
@given(names, names)
def test_dot_dot_is_refused_anywhere(a, b):
    with pytest.raises(InvalidName):
        check_name(a[:30] + ".." + b[:30])


@fuzz
@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{63,100}", fullmatch=True))
def test_too_long_names_are_refused(name):
    with pytest.raises(InvalidName):
        check_name(name)
    assert check_name(name[:63]) == name[:63]


@fuzz
@given(st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.lists(st.text(max_size=3), max_size=2)))
def test_non_strings_are_refused(value):
    for check in (check_name, check_object_id, check_uuid, parse_ref, check_host):
        with pytest.raises(InvalidName):
            check(value)


# -- NAME@V -----------------------------------------------------------------------------------------


@fuzz
@given(names, versions)
def test_name_at_version_round_trips(name, v):
    ref = parse_ref(f"{name}@{v}")
    assert ref == VersionRef(name, v)
    assert str(ref) == f"{name}@{v}"
    assert parse_ref(str(ref)) == ref


@fuzz
@given(st.text(max_size=80))
def test_parse_ref_accepts_only_canonical_refs_and_fails_only_with_invalid_name(text):
    try:
        ref = parse_ref(text)
    except InvalidName:
        return
    assert str(ref) == text  # one spelling per version: what is accepted prints back the same
    assert ref.version is None or 1 <= ref.version < 10**9


@fuzz
@given(names, st.sampled_from(["0", "00", "01", "-1", "+1", " 1", "1 ", "1\n", "1.0", "1e3", "0x1",
                               "\u0661", "\u00b2", "\uff11", "1_000", "1000000000", "", "1@2"]))
def test_bad_versions_are_refused(name, ver):
    with pytest.raises(InvalidName):
        parse_ref(f"{name}@{ver}")


# -- object ids and uuids ---------------------------------------------------------------------------


@fuzz
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=70))
def test_accepted_object_ids_are_64_lowercase_hex(text):
    try:
        check_object_id(text)
    except InvalidName:
        assert not (len(text) == 64 and set(text) <= HEX_DOC)
        return
    assert len(text) == 64 and set(text) <= HEX_DOC


@fuzz
@given(object_ids, st.integers(min_value=0, max_value=63), st.sampled_from(BAD_CHARS + ["A", "F", "g", "/", "."]))
def test_object_id_with_a_bad_character_is_refused(oid, pos, c):
    with pytest.raises(InvalidName):
        check_object_id(insert(oid, pos, c))  # one character too many
    with pytest.raises(InvalidName):
        check_object_id(oid[:pos] + c + oid[pos + 1:])  # the right length, one foreign character


@fuzz
@given(object_ids, st.integers(min_value=1, max_value=63))
def test_short_object_ids_are_refused(oid, n):
    with pytest.raises(InvalidName):
        check_object_id(oid[:n])


@fuzz
@given(st.uuids())
def test_uuids_in_canonical_form_are_accepted_and_others_refused(u):
    text = str(u)
    assert check_uuid(text) == text
    for bad in (text.upper(), text.replace("-", ""), "{" + text + "}", text + "\n", text[:-1], "urn:uuid:" + text):
        if bad != text:
            with pytest.raises(InvalidName):
                check_uuid(bad)


# -- the same rules where they are enforced: peer records, chain specs, manifests, hosts ---------


def _record() -> dict:
    return {
        "capsule": "demo", "number": 3, "uuid": "123e4567-e89b-12d3-a456-426614174000", "image": "tiny",
        "parent_capsule": None, "parent_version": None, "memory": None, "chains": [["a" * 64, "b" * 64]],
        "config": {"memory_mib": 256, "vcpus": 1, "kernel": "c" * 64, "initrd": "d" * 64, "cmdline": "",
                   "marker": "m", "image": "tiny"},
        "note": "", "created": 1.0,
    }


def test_a_good_record_passes():
    assert validate(_record())["capsule"] == "demo"


FIELDS = [("capsule",), ("image",), ("parent_capsule",), ("uuid",), ("memory",), ("config", "kernel"),
          ("config", "initrd"), ("config", "image"), ("chains", 0, 0)]


@fuzz
@given(st.sampled_from(FIELDS), st.integers(min_value=0, max_value=80), bad_chars)
def test_a_peer_record_with_a_bad_name_or_id_is_refused(path, pos, c):
    record = _record()
    record["memory"] = "e" * 64
    record["parent_capsule"] = "base"
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = insert(target[path[-1]], pos, c)
    with pytest.raises(InvalidName):
        validate(record)


@fuzz
@given(st.sampled_from(FIELDS + [("number",), ("parent_version",)]),
       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=70), st.lists(st.none())))
def test_a_peer_record_either_passes_with_valid_fields_or_fails_with_invalid_name(path, value):
    record = copy.deepcopy(_record())
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        validate(record)
    except InvalidName:
        return
    if path in (("capsule",), ("config", "kernel"), ("config", "initrd"), ("chains", 0, 0)):
        assert isinstance(value, str)
    if isinstance(value, str) and path != ("uuid",):
        assert NAME_DOC.fullmatch(value) and len(value) <= 64
    if path in (("number",), ("parent_version",)) and value is not None:
        assert type(value) is int and 1 <= value < 10**9


@pytest.mark.parametrize("suffix", ["\n", "\0", "/", "\u0430"])
def test_chain_spec_refuses_bad_layer_ids_and_names(suffix):
    good = LayerSpec(id="a" * 64, manifest_path="m", local_path="l")
    ChainSpec(layers=(good,), shadow_dir="s", name="capsule-1234abcd-demo-disk0")
    with pytest.raises(SpecError):
        ChainSpec(layers=(LayerSpec(id="a" * 64 + suffix, manifest_path="m", local_path="l"),), shadow_dir="s")
    with pytest.raises(SpecError):
        ChainSpec(layers=(good,), shadow_dir="s", name="demo" + suffix)


@fuzz
@given(st.text(max_size=110))
def test_chain_names_are_ascii(name):
    good = LayerSpec(id="a" * 64, manifest_path="m", local_path="l")
    try:
        ChainSpec(layers=(good,), shadow_dir="s", name=name)
    except SpecError:
        return
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) and len(name) <= 100 and "/" not in name


@pytest.mark.parametrize("parent", ["a" * 64 + "\n", "A" * 64, "a" * 63, "a" * 64 + "\0"])
def test_manifest_refuses_bad_parent_ids(parent):
    Manifest(KIND_LAYER, ALGORITHM, 65536, 0, "a" * 64, b"")
    with pytest.raises(ManifestError):
        Manifest(KIND_LAYER, ALGORITHM, 65536, 0, parent, b"")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "a-b.example", "192.0.2.10", "fe80::1"])
def test_good_hosts(host):
    assert check_host(host) == host


@fuzz
@given(st.from_regex(r"[a-z0-9]{1,10}(\.[a-z0-9]{1,10}){0,3}", fullmatch=True), st.integers(0, 40), bad_chars)
def test_hosts_with_a_bad_character_are_refused(host, pos, c):
    assume(c not in ":")  # a ':' may make an IPv6 address
    with pytest.raises(InvalidName):
        check_host(insert(host, pos, c))
    with pytest.raises(InvalidName):
        parse_listen(f"{insert(host, pos, c)}:7070")


@pytest.mark.parametrize("listen", ["127.0.0.1:\u0661\u0662", "127.0.0.1:7070\n", "127.0.0.1:\u00b2",
                                    "127.0.0.1:0", "127.0.0.1:65536", "-x:80", "a..b:80", "a/b:80"])
def test_listen_is_checked(listen):
    with pytest.raises(InvalidName):
        parse_listen(listen)


def test_listen_defaults_and_brackets():
    assert parse_listen(":7070") == ("127.0.0.1", 7070)
    assert parse_listen("[::1]:7070") == ("::1", 7070)
    assert parse_listen("0.0.0.0:80") == ("0.0.0.0", 80)


# -- sizes ------------------------------------------------------------------------------------------

SIZE_DOC = re.compile(r"[ \t\n\r\f\v]*[0-9]+(\.[0-9]+)?[ \t\n\r\f\v]*[kKmMgGtT]?(i?[bB])?[ \t\n\r\f\v]*")


@fuzz
@given(st.text(max_size=20))
def test_accepted_sizes_are_ascii_numbers_with_a_unit(text):
    try:
        n = parse_size(text)
    except InvalidName:
        assert not SIZE_DOC.fullmatch(text)
        return
    assert SIZE_DOC.fullmatch(text) and n >= 0


@pytest.mark.parametrize("text", ["\u0661\u0662\u0668M", "\uff11G", "1\u00a0G", "12\u0668"])
def test_sizes_in_other_scripts_are_refused(text):
    with pytest.raises(InvalidName):
        parse_size(text)
