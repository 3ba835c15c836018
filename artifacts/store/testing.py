"""Package archives for tests (everyone's): build one from a dict, or pack an example.

Not used by the server itself.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
_SKIP_PARTS = {"__pycache__", ".pytest_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def build_archive(files: dict[str, str | bytes], fmt: str = "tar.gz") -> bytes:
    """An archive (``"tar.gz"`` or ``"zip"``) holding ``files`` (path -> text or bytes)."""
    if fmt not in ("tar.gz", "zip"):
        raise ValueError(f"fmt must be 'tar.gz' or 'zip', got {fmt!r}")
    out = io.BytesIO()
    items = [(name, c.encode() if isinstance(c, str) else c) for name, c in files.items()]
    if fmt == "zip":
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, content in items:
                zf.writestr(name, content)
    else:
        with tarfile.open(fileobj=out, mode="w:gz") as tar:
            for name, content in items:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def example_files(name: str = "etl-demo") -> dict[str, bytes]:
    """The files of ``examples/<name>/`` as ``{relative/path: bytes}`` (caches skipped)."""
    root = EXAMPLES_DIR / name
    if not (root / "cloacina.toml").is_file():
        raise FileNotFoundError(f"no example package at {root}")
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or _SKIP_PARTS & set(rel.parts) or path.suffix in _SKIP_SUFFIXES:
            continue
        files[rel.as_posix()] = path.read_bytes()
    return files


def example_archive(name: str = "etl-demo", fmt: str = "tar.gz") -> bytes:
    """``examples/<name>/`` packed as an uploadable archive."""
    return build_archive(example_files(name), fmt)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def manifest_toml(
    tasks: list[dict],
    *,
    name: str = "demo",
    version: str = "1.0.0",
    kind: str = "python",
    workflow: str = "demo",
) -> str:
    """A cloacina.toml for ``tasks`` (each a dict of task keys, written as given)."""
    lines = [
        "[package]",
        f"name = {_toml_value(name)}",
        f"version = {_toml_value(version)}",
        f"kind = {_toml_value(kind)}",
        "",
        "[workflow]",
        f"name = {_toml_value(workflow)}",
    ]
    for task in tasks:
        lines += ["", "[[tasks]]"] + [f"{k} = {_toml_value(v)}" for k, v in task.items()]
    return "\n".join(lines) + "\n"


def package_files(
    tasks: list[dict] | None = None, source: str | None = None, **manifest: str
) -> dict[str, str | bytes]:
    """Files of a small valid package: module ``demo.steps`` under workflow/ defining a and b.

    ``tasks`` defaults to ``a`` then ``b`` depending on it; ``manifest`` keywords go to
    :func:`manifest_toml`.
    """
    if tasks is None:
        tasks = [
            {"id": "a", "function": "demo.steps:a"},
            {"id": "b", "function": "demo.steps:b", "dependencies": ["a"]},
        ]
    if source is None:
        source = "def a(context):\n    return {'a': 1}\n\n\ndef b(context):\n    return None\n"
    return {
        "cloacina.toml": manifest_toml(tasks, **manifest),
        "workflow/demo/__init__.py": "",
        "workflow/demo/steps.py": source,
    }


def parse_bomb(source_bytes: int = 4 * 1024 * 1024) -> bytes:
    """A package whose task module is padded with ``x = 1`` to ``source_bytes`` of source: a
    few KB of gzip, and ~400 bytes of memory per source byte to ``ast.parse``."""
    source = "def a(context):\n    return None\n\n\ndef b(context):\n    return None\n\n\n"
    return build_archive(package_files(source=source + "x = 1\n" * (source_bytes // 6)))
