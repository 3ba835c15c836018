"""Top-level names of Python modules, found by :mod:`ast` in a child process.

``ast.parse`` costs up to ~400 bytes of memory per source byte (``x = 1`` repeated;
real code ~40) and seconds of CPU per megabyte, and an upload is tenant input. So the
server never parses tenant source in its own process: :func:`parse_top_level_names`
runs this file as a script (``python -I -S astcheck.py LIMIT``) whose first act is to
cap its own address space at LIMIT bytes. A parse bomb then ends in a MemoryError of
the child, and the server's memory never grows with it.

Stdlib only, and nothing imported from the project: the child starts with no
site-packages, no Django and none of the server's environment.

Wire format (both directions binary, one record per module, in order):
parent -> child ``<path>\\t<length>\\n<length bytes of source>``;
child -> parent one JSON line per module: ``{"names": [...]}`` or
``{"syntax": msg, "line": n}``; after a MemoryError the child writes
``{"memory": true}`` and exits 3.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MEMORY_EXIT = 3


def top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines at import time: defs, classes, assignments and imports,
    including those under top-level ``if``/``try`` blocks (e.g. optional imports)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            pending.extend(node.body)
            pending.extend(getattr(node, "orelse", []))
            pending.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return names


# -- the parent side ----------------------------------------------------------------------


@dataclass(frozen=True)
class ParseResult:
    """One module's outcome: its top-level names, or a syntax error, or over the limits."""

    names: frozenset[str] = frozenset()
    syntax_error: str | None = None  # "at line N: msg" or "msg"
    out_of_memory: bool = False
    timed_out: bool = False


def _frames(sources: dict[str, bytes]) -> bytes:
    return b"".join(
        f"{path}\t{len(source)}\n".encode() + source for path, source in sources.items()
    )


def _result(line: dict) -> ParseResult:
    if "names" in line:
        return ParseResult(names=frozenset(line["names"]))
    if "syntax" in line:
        at = f" at line {line['line']}" if line.get("line") else ""
        return ParseResult(syntax_error=f"syntax error{at}: {line['syntax']}")
    return ParseResult(out_of_memory=True)


def parse_top_level_names(
    sources: dict[str, bytes], memory_bytes: int, timeout_s: float
) -> dict[str, ParseResult]:
    """``{path: ParseResult}`` for ``sources``, parsed in order in one child process capped
    at ``memory_bytes`` of address space. Stops at the first module that runs the child out
    of memory or time: it and the modules after it get no entry but that one's failure."""
    if not sources:
        return {}
    command = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(memory_bytes)]
    try:
        run = subprocess.run(
            command, input=_frames(sources), capture_output=True, timeout=timeout_s, env={}
        )
        stdout, stderr, code, timed_out = run.stdout, run.stderr, run.returncode, False
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the child
        stdout, stderr, code, timed_out = exc.stdout or b"", b"", None, True
    results: dict[str, ParseResult] = {}
    paths = iter(sources)
    for raw in stdout.splitlines():
        if raw.endswith(b"}"):  # a line cut short by the memory limit is no answer
            results[next(paths)] = _result(json.loads(raw))
    pending = next(paths, None)
    if pending is None or any(r.out_of_memory for r in results.values()):
        return results
    # The child stopped early: the module it was on is the culprit.
    if not timed_out and code != MEMORY_EXIT and b"MemoryError" not in stderr:
        tail = stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"the parsing child failed (exit {code}): {tail}")
    results[pending] = ParseResult(out_of_memory=not timed_out, timed_out=timed_out)
    return results


# -- the child side -----------------------------------------------------------------------


def _read_frame(stream) -> tuple[str, bytes] | None:
    header = stream.readline()
    if not header:
        return None
    path, _, size = header.decode().rstrip("\n").rpartition("\t")
    return path, stream.read(int(size))


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _child_main(memory_bytes: int) -> int:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while (frame := _read_frame(sys.stdin.buffer)) is not None:
        path, source = frame
        try:
            tree = ast.parse(source, filename=path)
            _emit({"names": sorted(top_level_names(tree))})
        except MemoryError:
            # The tree is unreachable now; whatever freeing it gave back is enough to say so.
            _emit({"memory": True})
            return MEMORY_EXIT
        except RecursionError:
            _emit({"syntax": "nested too deeply to parse", "line": None})
        except (SyntaxError, ValueError) as exc:
            _emit({"syntax": getattr(exc, "msg", str(exc)), "line": getattr(exc, "lineno", None)})
        del frame, source
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1])))
