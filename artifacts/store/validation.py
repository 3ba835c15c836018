"""Validate an uploaded package without running a line of it.

Archive safety comes from :mod:`agents.sandbox.archive`, the DAG from
:mod:`artifacts.store.manifest`; here every ``module:function`` is found by reading
the source with :mod:`ast` (never importing it), because tenant code must not
run on the control plane.

What validation reads is bounded (:class:`ValidationLimits`: manifest size, task
count, source size of each task module) and the parsing itself runs in a child
process with a capped address space (:mod:`artifacts.store.astcheck`): a few KB of gzip
can hold megabytes of source, and ``ast.parse`` costs up to ~400 bytes per byte.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from agents.sandbox import archive
from artifacts.store.astcheck import ParseResult, parse_top_level_names, top_level_names
from artifacts.store.manifest import (
    MANIFEST_NAME,
    ManifestError,
    ManifestLimitError,
    parse_manifest,
)
from fleet.platform.config import get_config

SOURCE_ROOTS = ("workflow", "vendor")  # in sys.path order
# Compiled extension modules a native package may ship instead of .py source.
EXTENSION_SUFFIXES = (".so", ".pyd", ".dylib")


# The whole parse of one upload's task modules; with CLOACINA_MAX_MODULE_SOURCE_BYTES at
# its default one module parses in well under a second.
PARSE_TIMEOUT_S = 60.0

__all__ = [
    "PackageError",
    "PackageLimitError",
    "ValidatedPackage",
    "ValidationLimits",
    "top_level_names",
    "validate_members",
    "validate_package",
]


class PackageError(ValueError):
    """The archive is safe but its content is not a valid package (HTTP 422)."""


class PackageLimitError(PackageError):
    """The package is over a bound of what validation reads or spends (HTTP 413)."""


@dataclass(frozen=True)
class ValidationLimits:
    """What validating one upload may read and spend (README's configuration table)."""

    max_manifest_bytes: int
    max_module_source_bytes: int
    max_tasks: int
    memory_bytes: int  # address space of the parsing child
    timeout_s: float = PARSE_TIMEOUT_S

    @classmethod
    def from_config(cls) -> ValidationLimits:
        config = get_config()
        return cls(
            max_manifest_bytes=config.max_manifest_bytes,
            max_module_source_bytes=config.max_module_source_bytes,
            max_tasks=config.max_tasks,
            memory_bytes=config.validation_memory_bytes,
        )


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
    def task_names(self) -> list[str]:
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


def _extension_index(members: dict[str, bytes]) -> dict[str, str]:
    """``{"workflow/pkg/mod": member}`` for every compiled extension module, built once:
    looking each task's module up by scanning every member would be tasks × members."""
    index: dict[str, str] = {}
    for name in members:
        if name.endswith(EXTENSION_SUFFIXES):
            directory, leaf = posixpath.split(name)
            index.setdefault(posixpath.join(directory, leaf.split(".", 1)[0]), name)
    return index


def _find_extension(module: str, extensions: dict[str, str]) -> str | None:
    rel = module.replace(".", "/")
    return next(
        (extensions[k] for k in (f"{r}/{rel}" for r in SOURCE_ROOTS) if k in extensions), None
    )


def _task_modules(manifest: dict, members: dict[str, bytes]) -> dict[int, str]:
    """``{task index: source path}`` of the tasks whose module is Python source; 422 for a
    module that is neither source nor (in a native package) a compiled extension."""
    native = manifest["package"]["kind"] == "native"
    extensions = _extension_index(members) if native else {}
    paths: dict[int, str] = {}
    for index, task in enumerate(manifest["tasks"]):
        module = task["function"].split(":")[0]
        path = next((c for c in _module_candidates(module) if c in members), None)
        if path is not None:
            paths[index] = path
        elif not (native and _find_extension(module, extensions)):
            tried = ", ".join(_module_candidates(module))
            raise PackageError(
                f"tasks[{index}] (id {task['id']!r}): module {module!r} not found "
                f"(looked for {tried})"
            )
        # else compiled: its symbols can only be checked by loading it
    return paths


def _bounded_sources(paths: list[str], members: dict[str, bytes], limit: int) -> dict[str, bytes]:
    for path in paths:
        if len(members[path]) > limit:
            raise PackageLimitError(
                f"{path} is {len(members[path])} bytes of source; a task module may have at most "
                f"{limit} (CLOACINA_MAX_MODULE_SOURCE_BYTES)"
            )
    return {path: members[path] for path in paths}


def _parse_failure(path: str, result: ParseResult, limits: ValidationLimits) -> None:
    if result.out_of_memory:
        raise PackageLimitError(
            f"{path}: parsing it needs more than {limits.memory_bytes} bytes of memory "
            "(CLOACINA_VALIDATION_MEMORY_BYTES); the module is too large or too deeply nested"
        )
    if result.timed_out:
        raise PackageLimitError(
            f"{path}: parsing the task modules took longer than {limits.timeout_s:g} s"
        )
    if result.syntax_error:
        raise PackageError(f"{path}: {result.syntax_error}")


def check_functions(
    manifest: dict, members: dict[str, bytes], limits: ValidationLimits | None = None
) -> None:
    """Every task's ``module:function`` must exist under workflow/ or vendor/."""
    limits = limits or ValidationLimits.from_config()
    paths = _task_modules(manifest, members)
    # Task order: a module that stops the parse comes before every task with no result.
    sources = _bounded_sources(
        list(dict.fromkeys(paths.values())), members, limits.max_module_source_bytes
    )
    results = parse_top_level_names(sources, limits.memory_bytes, limits.timeout_s)
    for index, path in paths.items():
        _parse_failure(path, results[path], limits)
        task = manifest["tasks"][index]
        function = task["function"].split(":")[1]
        if function not in results[path].names:
            raise PackageError(
                f"tasks[{index}] (id {task['id']!r}): function {function!r} is not defined at "
                f"the top level of {path}"
            )


def _manifest(members: dict[str, bytes], limits: ValidationLimits) -> dict:
    if MANIFEST_NAME not in members:
        raise PackageError(f"{MANIFEST_NAME} not found at the root of the archive")
    size = len(members[MANIFEST_NAME])
    if size > limits.max_manifest_bytes:
        raise PackageLimitError(
            f"{MANIFEST_NAME} is {size} bytes; the limit is {limits.max_manifest_bytes} "
            "(CLOACINA_MAX_MANIFEST_BYTES)"
        )
    try:
        return parse_manifest(members[MANIFEST_NAME], max_tasks=limits.max_tasks)
    except ManifestLimitError as exc:
        raise PackageLimitError(f"{exc} (CLOACINA_MAX_TASKS)") from None
    except ManifestError as exc:
        raise PackageError(str(exc)) from None


def validate_members(
    members: dict[str, bytes], limits: ValidationLimits | None = None
) -> ValidatedPackage:
    """Check already-extracted files (see :func:`validate_package`)."""
    limits = limits or ValidationLimits.from_config()
    members = strip_single_root(members)
    manifest = _manifest(members, limits)
    if not any(name.startswith("workflow/") for name in members):
        raise PackageError("workflow/ directory (the Python source root) is missing or empty")
    check_functions(manifest, members, limits)
    return ValidatedPackage(manifest=manifest, members=members)


def validate_package(data: bytes, limits: ValidationLimits | None = None) -> ValidatedPackage:
    """Read the archive safely and validate it as a package.

    Raises :class:`agents.sandbox.archive.ArchiveError` for an unreadable or
    unsafe archive, :class:`PackageLimitError` for a package over ``limits`` (by
    default the server's configuration) and :class:`PackageError` for an invalid one.
    """
    return validate_members(archive.read_members(data), limits)
