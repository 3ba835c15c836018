"""Validate an uploaded package without running a line of it.

Archive safety comes from :mod:`agents.runtime.archive`, the DAG from
:mod:`artifacts.manifest`; here every ``module:function`` is found by reading
the source with :mod:`ast` (never importing it), because tenant code must not
run on the control plane.
"""

from __future__ import annotations

import ast
import posixpath
from dataclasses import dataclass, field

from agents.runtime import archive
from artifacts.manifest import MANIFEST_NAME, ManifestError, parse_manifest

SOURCE_ROOTS = ("workflow", "vendor")  # in sys.path order
# Compiled extension modules a native package may ship instead of .py source.
EXTENSION_SUFFIXES = (".so", ".pyd", ".dylib")


class PackageError(ValueError):
    """The archive is safe but its content is not a valid package (HTTP 422)."""


@dataclass(frozen=True)
class ValidatedPackage:
    """An upload that passed every check: its files and its normalised manifest."""

    manifest: dict
    members: dict[str, bytes] = field(repr=False)

    @property
    def name(self) -> str:
        return self.manifest["package"]["name"]

    @property
    def version(self) -> str:
        return self.manifest["package"]["version"]

    @property
    def kind(self) -> str:
        return self.manifest["package"]["kind"]

    @property
    def workflow_name(self) -> str:
        return self.manifest["workflow"]["name"]

    @property
    def task_ids(self) -> list[str]:
        return [task["id"] for task in self.manifest["tasks"]]


def strip_single_root(members: dict[str, bytes]) -> dict[str, bytes]:
    """Accept ``tar czf x.tar.gz mypkg/`` too: if cloacina.toml sits one level down in the
    only top-level directory, treat that directory as the root."""
    if MANIFEST_NAME in members or not members:
        return members
    tops = {name.split("/", 1)[0] for name in members}
    if len(tops) != 1 or any("/" not in name for name in members):
        return members
    top = tops.pop()
    if f"{top}/{MANIFEST_NAME}" not in members:
        return members
    return {name[len(top) + 1 :]: data for name, data in members.items()}


def _module_candidates(module: str) -> list[str]:
    rel = module.replace(".", "/")
    return [f"{root}/{rel}{tail}" for root in SOURCE_ROOTS for tail in (".py", "/__init__.py")]


def _find_extension(module: str, members: dict[str, bytes]) -> str | None:
    rel = module.replace(".", "/")
    for root in SOURCE_ROOTS:
        directory, base = posixpath.split(f"{root}/{rel}")
        for name in members:
            if posixpath.dirname(name) != directory:
                continue
            leaf = posixpath.basename(name)
            if leaf.split(".", 1)[0] == base and leaf.endswith(EXTENSION_SUFFIXES):
                return name
    return None


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


def check_functions(manifest: dict, members: dict[str, bytes]) -> None:
    """Every task's ``module:function`` must exist under workflow/ or vendor/."""
    parsed: dict[str, set[str]] = {}
    native = manifest["package"]["kind"] == "native"
    for index, task in enumerate(manifest["tasks"]):
        where = f"tasks[{index}] (id {task['id']!r})"
        module, function = task["function"].split(":")
        path = next((c for c in _module_candidates(module) if c in members), None)
        if path is None:
            if native and _find_extension(module, members):
                continue  # compiled: its symbols can only be checked by loading it
            tried = ", ".join(_module_candidates(module))
            raise PackageError(f"{where}: module {module!r} not found (looked for {tried})")
        if path not in parsed:
            try:
                parsed[path] = top_level_names(ast.parse(members[path], filename=path))
            except (SyntaxError, ValueError) as exc:
                line = getattr(exc, "lineno", None)
                at = f" at line {line}" if line else ""
                msg = getattr(exc, "msg", str(exc))
                raise PackageError(f"{path}: syntax error{at}: {msg}") from None
        if function not in parsed[path]:
            raise PackageError(
                f"{where}: function {function!r} is not defined at the top level of {path}"
            )


def validate_members(members: dict[str, bytes]) -> ValidatedPackage:
    """Check already-extracted files (see :func:`validate_package`)."""
    members = strip_single_root(members)
    if MANIFEST_NAME not in members:
        raise PackageError(f"{MANIFEST_NAME} not found at the root of the archive")
    try:
        manifest = parse_manifest(members[MANIFEST_NAME])
    except ManifestError as exc:
        raise PackageError(str(exc)) from None
    if not any(name.startswith("workflow/") for name in members):
        raise PackageError("workflow/ directory (the Python source root) is missing or empty")
    check_functions(manifest, members)
    return ValidatedPackage(manifest=manifest, members=members)


def validate_package(data: bytes) -> ValidatedPackage:
    """Read the archive safely and validate it as a package.

    Raises :class:`agents.runtime.archive.ArchiveError` for an unreadable or
    unsafe archive and :class:`PackageError` for an invalid package.
    """
    return validate_members(archive.read_members(data))
