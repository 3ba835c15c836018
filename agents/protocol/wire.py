"""The wire format of work packets and results: JSON (readable) or MessagePack (compact).

An agent states the format it speaks when it registers; each socket then speaks its
agent's format.  A server accepts both (``CLOACINA_WIRE_FORMAT=auto``, the default) or
insists on one (``json`` or ``msgpack``: an agent speaking the other is refused at
registration).  Agents speak MessagePack unless told otherwise (smaller frames, cheaper
to encode and decode on both sides); JSON stays accepted for any agent that speaks only
it, and an agent refused for its format tries the other once.  This codec is the last
fence: a frame in the other format, or one that does not hold a plain JSON object,
raises :class:`WireFormatError` instead of decoding into a garbled task.

Both formats carry exactly the JSON data model (objects with string keys, arrays,
strings, finite numbers, 64-bit integers, booleans, null), so switching the format
never changes what a task sees.  ``encode`` refuses anything else, naming where it is.

DB-free: imported by the agent runtime and by the server alike.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import msgpack

WireFormat = Literal["json", "msgpack"]
SUPPORTED_FORMATS: tuple[str, ...] = ("json", "msgpack")
# What a server may be set to: either format, each socket in its agent's ("auto"), or one.
ACCEPT_ANY = "auto"
SERVER_SETTINGS: tuple[str, ...] = (ACCEPT_ANY, *SUPPORTED_FORMATS)
DEFAULT_AGENT_FORMAT: WireFormat = "msgpack"
# JSON frames go out as WebSocket text, MessagePack frames as binary.
BINARY_FORMATS = frozenset({"msgpack"})

# MessagePack integers are at most 64 bits; refusing the same range in JSON keeps both
# formats able to carry every value the other can.
MIN_INT = -(2**63)
MAX_INT = 2**64 - 1
MAX_DEPTH = 64  # deeper nesting is a bug or an attack, never a task context

_JSON_MISMATCH_HINT = "binary data that is not UTF-8 (a MessagePack frame?)"

# A ``batch`` frame carries several frames, each exactly as it would travel alone
# (docs/agent-protocol.md, "Batched frames").  It is built by joining frames already
# encoded (and checked) one by one, so batching costs no second encode, and a frame
# alone in its loop turn goes out byte for byte as before.
BATCH = "batch"
BATCH_FIELD = "frames"
_BATCH_MSGPACK_HEAD = msgpack.packb({"type": BATCH}, use_bin_type=True)[1:]  # the entry
_BATCH_MSGPACK_FIELD = msgpack.packb(BATCH_FIELD, use_bin_type=True)
_BATCH_JSON_HEAD = '{"type":"batch","frames":['
# Bytes a batch adds around its frames: the envelope and an array header (msgpack) or the
# commas (json) — an upper bound for both, for the sender's size budget.
BATCH_OVERHEAD_BYTES = 32


class WireFormatError(ValueError):
    """A value cannot be encoded, or a frame cannot be decoded, in the stated wire format."""


def check_format(fmt: str) -> str:
    """``fmt`` itself if it is a supported format name; otherwise a WireFormatError listing them."""
    if fmt not in SUPPORTED_FORMATS:
        raise WireFormatError(
            f"unknown wire format {fmt!r}; supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    return fmt


def is_binary(fmt: str) -> bool:
    """Whether frames of ``fmt`` travel as binary WebSocket messages (else text)."""
    return check_format(fmt) in BINARY_FORMATS


def require_same_format(server_format: str, agent_format: str) -> None:
    """Refuse an agent whose format the server does not accept, naming both (registration):
    a server set to ``auto`` accepts every supported format, one set to a format only it."""
    check_format(agent_format)
    if server_format == ACCEPT_ANY:
        return
    check_format(server_format)
    if server_format != agent_format:
        raise WireFormatError(
            f"wire format mismatch: the server speaks {server_format}, the agent speaks "
            f"{agent_format}; start the agent with the server's format ({server_format})"
        )


class _Refused(Exception):
    """Internal: why a value is refused, and the path to it, collected while unwinding."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.steps: list[str] = []  # innermost first


def _check_value(value: Any, where: str) -> None:
    """Refuse anything outside the JSON data model, naming its path (e.g. ``$.context.when``).

    Every frame in and out passes here, on the agent and on the server: the walk builds
    no path text while the value is good, only once it finds what it refuses.
    """
    try:
        _walk(value, 0)
    except _Refused as exc:
        raise WireFormatError(f"{where}{''.join(reversed(exc.steps))}: {exc.reason}") from None


def _walk(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
    kind = type(value)
    # The exact built-in types first; subclasses (an IntEnum, an OrderedDict) and what is
    # refused go the long way round (_check_other).
    if kind is str or value is None or kind is bool:
        return
    if kind is dict:
        _walk_object(value, depth)
    elif kind is list:
        _walk_array(value, depth)
    elif kind is int:
        if not MIN_INT <= value <= MAX_INT:
            raise _Refused(f"integer {value} does not fit in 64 bits")
    elif kind is float:
        if not math.isfinite(value):
            raise _Refused(f"{value} is not a finite number")
    else:
        _check_other(value, depth)


# Values checked where they stand, without a call to _walk: most of a frame's values are
# strings, small integers, booleans and nulls, and a call per value was most of the check.
_LEAF_TYPES = frozenset({str, bool, type(None)})


def _walk_object(value: dict, depth: int) -> None:
    inline = depth < MAX_DEPTH  # a leaf one level down is within the depth limit
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            # JSON would silently turn 1 into "1": a different object on the other side.
            raise _Refused(f"object key {key!r} is {type(key).__name__}, keys must be strings")
        if inline:
            kind = type(item)
            if kind in _LEAF_TYPES or (kind is int and MIN_INT <= item <= MAX_INT):
                continue
        try:
            _walk(item, depth + 1)
        except _Refused as exc:
            exc.steps.append(f".{key}")
            raise


def _walk_array(value: list | tuple, depth: int) -> None:
    inline = depth < MAX_DEPTH
    for index, item in enumerate(value):
        if inline:
            kind = type(item)
            if kind in _LEAF_TYPES or (kind is int and MIN_INT <= item <= MAX_INT):
                continue
        try:
            _walk(item, depth + 1)
        except _Refused as exc:
            exc.steps.append(f"[{index}]")
            raise


def _check_other(value: Any, depth: int) -> None:
    """A subclass of a JSON type is checked as that type; anything else is refused."""
    if isinstance(value, str):
        return
    if isinstance(value, int):  # bool included
        if not isinstance(value, bool) and not MIN_INT <= value <= MAX_INT:
            raise _Refused(f"integer {value} does not fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Refused(f"{value} is not a finite number")
        return
    if isinstance(value, dict):
        _walk_object(value, depth)
        return
    if isinstance(value, msgpack.ExtType):
        # A tuple subclass, so test it first: an extension type is no JSON value.
        raise _Refused("ExtType (MessagePack extension) is not a JSON type")
    if isinstance(value, list | tuple):
        _walk_array(value, depth)
        return
    raise _Refused(
        f"{type(value).__name__} is not a JSON type (object, array, string, number, boolean, null)"
    )


def _check_object(value: Any, fmt: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireFormatError(
            f"{fmt} frame holds a {type(value).__name__}, not an object "
            "(packets and results are objects)"
        )
    inner = value.get(BATCH_FIELD) if value.get("type") == BATCH else None
    if isinstance(inner, list):
        # Each frame of a batch is checked as the frame it would be alone (its own depth
        # budget), so a frame that passes alone passes batched.
        for index, frame in enumerate(inner):
            if not isinstance(frame, dict):
                raise WireFormatError(f"$.{BATCH_FIELD}[{index}]: a batched frame is an object")
            _check_value(frame, f"$.{BATCH_FIELD}[{index}]")
        _check_value({k: v for k, v in value.items() if k != BATCH_FIELD}, "$")
        return value
    _check_value(value, "$")
    return value


def join_frames(encoded: list[str] | list[bytes], fmt: str) -> str | bytes:
    """One ``batch`` frame carrying ``encoded`` — frames :func:`encode` made, in order —
    without decoding or encoding them again."""
    if check_format(fmt) == "msgpack":
        count = len(encoded)
        if count < 16:
            header = bytes((0x90 | count,))
        elif count < 65536:
            header = b"\xdc" + count.to_bytes(2, "big")
        else:
            header = b"\xdd" + count.to_bytes(4, "big")
        return b"".join(
            (b"\x82", _BATCH_MSGPACK_HEAD, _BATCH_MSGPACK_FIELD, header, *encoded)  # type: ignore[arg-type]
        )
    return _BATCH_JSON_HEAD + ",".join(encoded) + "]}"  # type: ignore[arg-type]


def encode(obj: dict[str, Any], fmt: str) -> str | bytes:
    """``obj`` as a frame: compact JSON text (``str``) or MessagePack ``bytes``."""
    check_format(fmt)
    _check_object(obj, fmt)
    if fmt == "msgpack":
        return msgpack.packb(obj, use_bin_type=True)
    # ensure_ascii=False keeps non-ASCII text readable in a debugger or a packet capture.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _decode_json(data: str | bytes) -> Any:
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise WireFormatError(
                f"expected a json frame, got {_JSON_MISMATCH_HINT}; this connection speaks json"
            ) from None
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise WireFormatError(
            f"expected a json frame, got text that is not JSON ({exc.msg} at char {exc.pos})"
        ) from None
    except RecursionError:
        raise WireFormatError(f"json frame is nested more than {MAX_DEPTH} levels deep") from None


def _refuse_constant(name: str) -> Any:
    raise WireFormatError(f"json frame holds {name}, which is not a finite number")


def _decode_msgpack(data: str | bytes) -> Any:
    if isinstance(data, str):
        raise WireFormatError(
            "expected a msgpack (binary) frame, got a text frame (a JSON frame?); "
            "this connection speaks msgpack"
        )
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except msgpack.ExtraData:
        # A JSON text "{...}" unpacks as the integer 123 followed by garbage.
        raise WireFormatError(
            "expected a msgpack frame, got bytes with trailing data (a JSON frame?)"
        ) from None
    except (ValueError, TypeError, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireFormatError(f"expected a msgpack frame, got unreadable bytes ({exc})") from None


def decode(data: str | bytes, fmt: str) -> dict[str, Any]:
    """The object a frame of format ``fmt`` carries.

    A JSON frame may arrive as text or as UTF-8 bytes (a REST body); a MessagePack
    frame must be bytes.  Anything else, a frame in the other format, or content
    outside the JSON data model raises :class:`WireFormatError`.
    """
    check_format(fmt)
    value = _decode_msgpack(data) if fmt == "msgpack" else _decode_json(data)
    return _check_object(value, fmt)
