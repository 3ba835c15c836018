"""The shared context builder, and proof that the in-process child gets exactly its bytes.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_engine_context.py.
"""

from __future__ import annotations

import pytest

from fleet.engine.context import (
    ContextError,
    encode_context,
    validate_context,
)


def test_encode_context_is_compact_and_keeps_unicode():
    assert encode_context({"b": "é", "a": [1, 2.5]}) == '{"b":"é","a":[1,2.5]}'


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1], "context must be a JSON object, got list"),
        ({"x": float("inf")}, "context is not valid JSON"),
        ({"x": object()}, "context is not JSON-serialisable"),
        ({"x": "y" * 50}, "over the 20-byte limit"),
    ],
)
def test_validate_context_names_the_problem(value, message):
    with pytest.raises(ContextError, match=message):
        validate_context(value, max_bytes=20)
