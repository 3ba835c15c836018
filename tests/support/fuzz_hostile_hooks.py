"""Schemathesis hooks for the hostile-body run of tests/e2e/test_fuzz_api.py.

Loaded with ``SCHEMATHESIS_HOOKS=tests.fuzz_hostile_hooks``.  Every generated request
keeps its URL, parameters and key, but its body is replaced, in turn, by one the server
used to answer with a 500:

* a JSON body whose first value is NaN, Infinity or -Infinity;
* a JSON body holding a lone surrogate as raw bytes (invalid UTF-8), or escaped
  (``"\\ud800"``), or an escaped NUL;
* a package upload whose cloacina.toml holds a NUL in a routing string (tags, agent,
  capability, group, gpu, affinity).

The server must answer each with a documented 4xx, never a 5xx.  Each request's mutation
and status are appended to ``$CLOACINA_FUZZ_HOSTILE_LOG`` ("name<TAB>status" lines), so the
test can check that every mutation was sent and refused.  DB-free: it runs in the
schemathesis process.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import schemathesis

from artifacts.store.testing import build_archive, package_files

_MARK = "\x01hostile\x01"
LONE_SURROGATE_BYTES = b"\xed\xa0\x80"  # U+D800 encoded as if it were a character
ROUTING_KEYS = ("tags", "agent", "capability", "group", "gpu", "affinity")


def _nan(text: str) -> bytes:
    return text.replace(json.dumps(_MARK), "NaN").encode()


def _infinity(text: str) -> bytes:
    return text.replace(json.dumps(_MARK), "Infinity").encode()


def _minus_infinity(text: str) -> bytes:
    return text.replace(json.dumps(_MARK), "-Infinity").encode()


def _raw_surrogate(text: str) -> bytes:
    return (
        text.replace(json.dumps(_MARK), '"a' + "\uffff" + '"')
        .encode()
        .replace("\uffff".encode(), LONE_SURROGATE_BYTES)
    )


def _escaped_surrogate(text: str) -> bytes:
    return text.replace(json.dumps(_MARK), '"\\ud800"').encode()


def _escaped_nul(text: str) -> bytes:
    return text.replace(json.dumps(_MARK), '"a\\u0000b"').encode()


JSON_MUTATIONS = (
    _nan, _infinity, _minus_infinity, _raw_surrogate, _escaped_surrogate, _escaped_nul
)  # fmt: skip
_json_turn = itertools.cycle(JSON_MUTATIONS)
_routing_turn = itertools.cycle(ROUTING_KEYS)


def _marked(body: Any) -> Any:
    """``body`` with its first leaf value (depth first) replaced by the mark, or the mark
    added as a key; the mark is then swapped for the hostile text."""
    if isinstance(body, dict):
        for key, value in body.items():
            if isinstance(value, dict | list) and value:
                return {**body, key: _marked(value)}
            return {**body, key: _MARK}
        return {"hostile": _MARK}
    if isinstance(body, list) and body:
        return [_marked(body[0]), *body[1:]]
    return {"hostile": _MARK}


def _manifest_with_nul() -> bytes:
    key = next(_routing_turn)
    value: Any = ["fast", "a\x00b"] if key == "tags" else "a\x00b"
    if key == "affinity":
        value = "payload:a\x00b"
    tasks = [{"id": "a", "function": "demo.steps:a", key: value}]
    return build_archive(package_files(tasks))


_sent: dict[int, str] = {}  # id(case) -> the mutation its request carried


@schemathesis.hook
def before_call(ctx, case, kwargs: dict) -> None:
    media_type = (case.media_type or "").split(";")[0]
    if media_type == "multipart/form-data" and isinstance(case.body, dict) and "file" in case.body:
        kwargs["files"] = {"file": ("hostile.tar.gz", _manifest_with_nul(), "application/gzip")}
        kwargs["data"] = {k: str(v) for k, v in case.body.items() if k != "file"}
        _sent[id(case)] = "manifest_nul"
    elif media_type == "application/json":
        mutation = next(_json_turn)
        kwargs["data"] = mutation(json.dumps(_marked(case.body), ensure_ascii=True))
        _sent[id(case)] = mutation.__name__.lstrip("_")


@schemathesis.hook
def after_call(ctx, case, response) -> None:
    mutation = _sent.pop(id(case), None)
    log = os.environ.get("CLOACINA_FUZZ_HOSTILE_LOG")
    if mutation and log:
        with open(log, "a") as fh:
            fh.write(f"{mutation}\t{response.status_code}\n")
