"""No file outside the store is written on behalf of a request, on every route of the agent: each path
parameter, and each string of each request body (built from the route's own OpenAPI schema), is given a
path trick in turn — parent steps deep enough to leave the store and land in this test's directory, an
absolute path into it, a NUL, dots — by the admin. Every answer is a clear refusal (never a 500), and the
directory around the store holds afterwards exactly what it held before."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from capsule.agent import authz
from capsule.agent.app import create_app
from tests.unit.test_accounts_agent import SECRET, TOKEN, make_home

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

DEPTH = 6   # the store lives this many directories below the test's directory
SKIP = {"WS", "MOUNT"}
PLAIN = {"name": SECRET, "kind": "layer", "oid": "ab" * 32, "number": "1", "host": "office", "mid": "m1"}


def tricks(root: Path) -> list[str]:
    """Names that escape a directory of the store into ``root``'s tree, when a route joins them unchecked."""
    out = ["..", ".", "...", "a\x00b", "a/../../b", str(root / "escape-abs"), "~root", "%2e%2e%2fx"]
    out += ["../" * k + f"escape-{k}" for k in range(1, DEPTH + 4)]
    return out


def tree(root: Path, skip: Path) -> set[str]:
    seen = set()
    for d, dirs, files in os.walk(root):
        if Path(d) == skip:
            dirs[:] = []
            continue
        seen.update(os.path.relpath(os.path.join(d, f), root) for f in [*dirs, *files])
    return seen


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:   # Optional[X]: the X
        schema = next((s for s in schema["anyOf"] if s.get("type") != "null"), schema["anyOf"][0])
        return _resolve(schema, spec)
    return schema


def bodies(schema: dict[str, Any], spec: dict[str, Any], hostile: str) -> list[Any]:
    """One body per string field, that field hostile and every other one a plain valid value."""
    schema = _resolve(schema, spec)
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        plain = {k: bodies(v, spec, "")[0] if bodies(v, spec, "") else None for k, v in props.items()}
        out = []
        for key, sub in props.items():
            for variant in bodies(sub, spec, hostile):
                if variant != plain[key]:
                    out.append({**plain, key: variant})
        return out or [plain]
    if kind == "array":
        return [[x] for x in bodies(schema.get("items", {}), spec, hostile)]
    if kind == "string":
        return [hostile or "plain"]
    if kind == "integer":
        return [1]
    if kind == "number":
        return [1.0]
    if kind == "boolean":
        return [False]
    return [hostile or "plain"]


def test_no_route_writes_outside_the_store(tmp_path):
    root = tmp_path
    home = make_home(root.joinpath(*[f"d{i}" for i in range(DEPTH - 1)]))
    app = create_app(home, TOKEN)
    spec = app.openapi()
    client = TestClient(app, raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    before = tree(root, home)
    served = [(m, p) for m, p in authz.routes_of(app) if m not in SKIP]
    assert len(served) >= 40
    asked, failures, statuses = 0, [], Counter()
    for method, template in served:
        params = [seg[1:-1].split(":")[0] for seg in template.split("/") if seg.startswith("{")]
        body_schema = (spec["paths"].get(template, {}).get(method.lower(), {}).get("requestBody", {})
                       .get("content", {}).get("application/json", {}).get("schema"))
        for hostile in tricks(root):
            urls = []
            for p in params:   # one hostile parameter at a time, the others plain
                url = template
                for q in params:
                    url = url.replace("{" + q + ("}" if "{" + q + "}" in template else ":path}"),
                                      quote(hostile, safe="") if q == p else PLAIN.get(q, "plain"))
                urls.append(url)
            if not params:
                urls.append(template)
            for url in urls:
                for body in (bodies(body_schema, spec, hostile) if body_schema else [None]):
                    r = client.request(method, url, json=body)
                    asked += 1
                    statuses[r.status_code] += 1
                    if r.status_code >= 500:
                        failures.append(f"{method} {url} {body!r}: {r.status_code} {r.text[:200]}")
    assert asked > 500
    # many were refused by the route itself (a bad name, a bad body), not by the router for want of a match
    assert sum(n for code, n in statuses.items() if code in (400, 403, 409, 413, 422)) > asked // 5, statuses
    assert failures == []
    assert tree(root, home) == before, "a request wrote outside the store"
