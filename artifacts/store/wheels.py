"""Per-target builds made by the server: vendor platform wheels of a native package.

A native package whose root holds a ``requirements.txt`` can have its per-target
builds produced here instead of uploaded: for the target triple, ``pip download``
fetches binary wheels for that platform's tags (never an sdist, so no tenant or
third-party build code runs on the control plane), their files are unpacked into
``vendor/`` of a copy of the primary build, and the result is published with
:func:`artifacts.store.services.publish_target_artifact` like an uploaded build.

The requirements file is tenant input handed to pip, so only plain requirement
lines (name, specifiers, markers, ``--hash``) are accepted: an option such as
``--index-url`` or ``-r /etc/passwd`` could make the server fetch or read what
the tenant chooses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import posixpath
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from agents.protocol.triples import TripleError, parse_triple
from agents.sandbox import archive
from artifacts.models import PackageArtifact, PackageKind, WorkflowPackage
from artifacts.store.build import canonical_archive
from artifacts.store.queries import find_package
from artifacts.store.services import UploadRejected, publish_target_artifact
from artifacts.store.storage import load_blob
from artifacts.store.validation import EXTENSION_SUFFIXES
from fleet.platform.config import get_config
from fleet.platform.errors import ErrorKind

if TYPE_CHECKING:
    from fleet.models import Tenant

REQUIREMENTS_FILE = "requirements.txt"
VENDOR_DIR = "vendor"
PIP_TIMEOUT_S = 300.0  # the whole download (a background job: no request waits for it)
PIP_SOCKET_TIMEOUT_S = 30  # one stalled connection to the index
PIP_RETRIES = 2
PIP_WATCH_INTERVAL_S = 0.1  # how often the download directory is measured while pip runs
MAX_PIP_STDERR_BYTES = 64 * 1024  # the tail of pip's stderr kept for the error message
# The newest glibc a vendored manylinux wheel may need. Triples do not say which glibc
# an agent has; 2.28 (RHEL 8, Debian 10, Ubuntu 18.10) is the manylinux_2_28 baseline.
MANYLINUX_MAX_GLIBC_MINOR = 28
MUSLLINUX_MAX_MINOR = 2
MAX_PIP_ERROR_CHARS = 600

# (triple arch, C library) -> (wheel arch, oldest glibc minor with a manylinux tag).
_MANYLINUX_ARCHES = {
    "x86_64": ("x86_64", 5),
    "i686": ("i686", 5),
    "aarch64": ("aarch64", 17),
    "powerpc64le": ("ppc64le", 17),
    "s390x": ("s390x", 17),
    "armv7": ("armv7l", 17),
}
_MUSLLINUX_ARCHES = {"x86_64": "x86_64", "i686": "i686", "aarch64": "aarch64", "armv7": "armv7l"}
# PEP 599/571/513 names for the same glibc floors; some wheels carry only these.
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
_HASH_OPTION = re.compile(r"^--hash[= ](sha256|sha384|sha512):[0-9a-fA-F]+$")
_COMMENT = re.compile(r"(^|\s+)#.*$")
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")
_FROM_VERSIONS = re.compile(r"\(from versions: ([^)]*)\)")


def platform_tags(target_triple: str) -> list[str]:
    """pip ``--platform`` tags whose wheels load on ``target_triple``, most specific first.

    Only manylinux (glibc) and musllinux tags: a bare ``linux_x86_64`` wheel was built
    against one machine's libraries and promises nothing about another's.
    """
    try:
        triple = parse_triple(target_triple)
    except TripleError as exc:
        raise UploadRejected(ErrorKind.INVALID, str(exc)) from None
    env = triple.env or ""
    if triple.os == "linux" and env.startswith("gnu") and triple.arch in _MANYLINUX_ARCHES:
        arch, oldest = _MANYLINUX_ARCHES[triple.arch]
        tags = []
        for minor in range(MANYLINUX_MAX_GLIBC_MINOR, oldest - 1, -1):
            tags.append(f"manylinux_2_{minor}_{arch}")
            if minor in _LEGACY_MANYLINUX:
                tags.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
        return tags
    if triple.os == "linux" and env.startswith("musl") and triple.arch in _MUSLLINUX_ARCHES:
        arch = _MUSLLINUX_ARCHES[triple.arch]
        return [f"musllinux_1_{minor}_{arch}" for minor in range(MUSLLINUX_MAX_MINOR, -1, -1)]
    supported = [f"{a}-unknown-linux-gnu" for a in _MANYLINUX_ARCHES] + [
        f"{a}-unknown-linux-musl" for a in _MUSLLINUX_ARCHES
    ]
    raise UploadRejected(
        ErrorKind.INVALID,
        f"no wheel platform is known for target triple {target_triple!r}; the build step can "
        f"vendor wheels for {', '.join(supported)} — upload a build for other targets instead",
    )


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` per requirement, comments stripped, ``\\`` joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw).rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append((start, line))
    if pending.strip():
        out.append((start, pending.strip()))
    return out


def parse_requirements(text: str) -> list[str]:
    """The requirement lines of ``requirements.txt``, each checked; 422 naming a bad line.

    Accepted: ``name[extras] specifiers ; markers`` optionally followed by ``--hash=alg:hex``
    options. Refused: every other option (``--index-url``, ``-r``, ``-e``, ``-f`` …), direct
    URL references and ``${VAR}`` (pip would expand the server's environment into it).
    """
    requirements: list[str] = []
    for number, line in _logical_lines(text):
        where = f"{REQUIREMENTS_FILE} line {number}"
        if "$" in line:
            raise UploadRejected(
                ErrorKind.INVALID, f"{where}: '$' is not allowed (no environment variables)"
            )
        words = line.split()
        first_option = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
        spec, options = " ".join(words[:first_option]), words[first_option:]
        joined = [f"{a} {b}" if a == "--hash" else a for a, b in _pairs(options)]
        for option in joined:
            if not _HASH_OPTION.match(option):
                name = option.split("=", 1)[0].split(" ", 1)[0]
                raise UploadRejected(
                    ErrorKind.INVALID,
                    f"{where}: option {name!r} is not allowed; list requirements only "
                    "(name, version specifiers, markers, --hash)",
                )
        if not spec:
            raise UploadRejected(ErrorKind.INVALID, f"{where}: an option without a requirement")
        try:
            requirement = Requirement(spec)
        except InvalidRequirement as exc:
            raise UploadRejected(
                ErrorKind.INVALID, f"{where}: invalid requirement {spec!r}: {exc}"
            ) from None
        if requirement.url:
            raise UploadRejected(
                ErrorKind.INVALID,
                f"{where}: direct URL references ({spec!r}) are not allowed; name a version",
            )
        requirements.append(" ".join([spec, *(o.replace(" ", "=") for o in joined)]))
    if not requirements:
        raise UploadRejected(ErrorKind.INVALID, f"{REQUIREMENTS_FILE} lists no requirements")
    return requirements


def _pairs(options: list[str]) -> list[tuple[str, str]]:
    """Split options into (word, its value when the option is a bare ``--hash``)."""
    out: list[tuple[str, str]] = []
    index = 0
    while index < len(options):
        word = options[index]
        if word == "--hash" and index + 1 < len(options):
            out.append((word, options[index + 1]))
            index += 2
        else:
            out.append((word, ""))
            index += 1
    return out


def _python_version() -> str:
    # Agents run the same CPython minor as the server (one deployment, one image line).
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pip_failure(stderr: str, target_triple: str, tags: list[str]) -> UploadRejected:
    """Turn pip's stderr into the error the caller sees."""
    missing = _NO_MATCH.search(stderr)
    if missing:
        versions = _FROM_VERSIONS.search(stderr)
        found = (versions.group(1).strip() or "none") if versions else "none"
        return UploadRejected(
            ErrorKind.INVALID,
            f"requirement {missing.group(1)!r} has no wheel for {target_triple} (platform tags "
            f"{tags[0]} … {tags[-1]}, CPython {_python_version()}; versions with such a wheel: "
            f"{found}); the build vendors binary wheels only",
        )
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    text = " ".join(errors) or stderr.strip()[-MAX_PIP_ERROR_CHARS:]
    if "DO NOT MATCH THE HASHES" in stderr or "hash" in text.lower():
        return UploadRejected(
            ErrorKind.INVALID, f"a wheel for {target_triple} failed its --hash check: {text}"
        )
    return UploadRejected(
        ErrorKind.UPSTREAM_FAILED,
        f"pip download for {target_triple} failed: {text[:MAX_PIP_ERROR_CHARS]}",
    )


@dataclass
class DownloadMeter:
    """What one build's pip downloaded: the wheels' bytes once it is done; if it was killed,
    the most seen on disk (finished wheels and downloads in progress)."""

    bytes: int = 0


class BuildInterrupted(Exception):
    """The server is stopping: pip was killed and the build should be queued again."""


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root``; files pip removes while we look are skipped."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total


def _kill(process: subprocess.Popen) -> None:
    # pip runs in a session of its own, so its whole process group goes.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _over_cap(size: int, limit: int, target_triple: str) -> UploadRejected:
    return UploadRejected(
        ErrorKind.TOO_LARGE,
        f"pip download for {target_triple} wrote more than {limit} bytes (at least {size}); "
        "the limit is CLOACINA_MAX_BUILD_DOWNLOAD_BYTES",
    )


def _run_pip(
    command: list[str],
    dest: Path,
    target_triple: str,
    max_bytes: int,
    meter: DownloadMeter,
    stop: threading.Event | None,
) -> str:
    """Run pip, watching the bytes in ``dest`` and in its TMPDIR (where pip streams a
    download before moving it to ``dest``): past ``max_bytes``, past the timeout or on
    ``stop`` it is killed. Returns the tail of its stderr; raises on a kill."""
    workdir = dest.parent
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    deadline = time.monotonic() + PIP_TIMEOUT_S
    # stderr to a file: a full pipe would block pip while we only watch the disk.
    with tempfile.TemporaryFile(dir=workdir) as stderr:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        try:
            while True:
                try:
                    returncode = process.wait(timeout=PIP_WATCH_INTERVAL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                meter.bytes = max(meter.bytes, _tree_bytes(dest) + _tree_bytes(tmp))
                if meter.bytes > max_bytes:
                    raise _over_cap(meter.bytes, max_bytes, target_triple)
                if time.monotonic() > deadline:
                    raise UploadRejected(
                        ErrorKind.UPSTREAM_TIMEOUT,
                        f"pip download for {target_triple} did not finish within "
                        f"{PIP_TIMEOUT_S:g} s",
                    )
                if stop is not None and stop.is_set():
                    raise BuildInterrupted(f"pip download for {target_triple} interrupted")
        finally:
            if process.poll() is None:
                _kill(process)
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - MAX_PIP_STDERR_BYTES))
        text = stderr.read().decode("utf-8", errors="replace")
    if returncode != 0:
        raise _pip_failure(text, target_triple, platform_tags(target_triple))
    return text


def download_wheels(
    requirements: list[str],
    target_triple: str,
    dest: Path,
    *,
    max_bytes: int | None = None,
    meter: DownloadMeter | None = None,
    stop: threading.Event | None = None,
) -> list[Path]:
    """Run ``pip download`` (binary only, dependencies resolved for the platform) into ``dest``.

    Honours the operator's pip configuration (index, mirror, certificates); the
    tenant's requirements cannot change it (see :func:`parse_requirements`). pip has no
    byte limit of its own, so :func:`_run_pip` watches the disk and kills it past
    ``max_bytes`` (default CLOACINA_MAX_BUILD_DOWNLOAD_BYTES); ``--no-cache-dir`` keeps
    it from filling the server's pip cache as well.
    """
    tags = platform_tags(target_triple)
    if importlib.util.find_spec("pip") is None:
        raise UploadRejected(
            ErrorKind.UNAVAILABLE, "pip is not installed on this server; the build step needs it"
        )
    limit = get_config().max_build_download_bytes if max_bytes is None else max_bytes
    meter = meter if meter is not None else DownloadMeter()
    requirements_path = dest.parent / "requirements.checked.txt"
    requirements_path.write_text("\n".join(requirements) + "\n")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--no-input",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--progress-bar=off",
        f"--timeout={PIP_SOCKET_TIMEOUT_S}",
        f"--retries={PIP_RETRIES}",
        "--implementation=cp",
        f"--python-version={_python_version()}",
        *(f"--platform={tag}" for tag in tags),
        f"--dest={dest}",
        "-r",
        str(requirements_path),
    ]
    _run_pip(command, dest, target_triple, limit, meter, stop)
    # A local or fast download can finish between two looks: count what it left.
    wheels = sorted(dest.glob("*.whl"))
    meter.bytes = sum(path.stat().st_size for path in wheels)
    if meter.bytes > limit:
        raise _over_cap(meter.bytes, limit, target_triple)
    return wheels


@dataclass(frozen=True)
class Wheel:
    """A downloaded wheel: its distribution name (canonical) and files (archive paths)."""

    filename: str
    name: str
    files: dict[str, bytes]


def read_wheel(path: Path, target_triple: str) -> Wheel:
    """Read a wheel with the safe archive reader, checking its platform tag a second time."""
    try:
        name, _version, _build, tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise UploadRejected(
            ErrorKind.UPSTREAM_FAILED, f"pip returned a file that is not a wheel: {exc}"
        ) from None
    allowed = set(platform_tags(target_triple)) | {"any"}
    if not any(tag.platform in allowed for tag in tags):
        raise UploadRejected(
            ErrorKind.UPSTREAM_FAILED, f"pip returned {path.name}, which is not for {target_triple}"
        )
    try:
        files = archive.read_members(path.read_bytes())
    except archive.ArchiveLimitError as exc:
        raise UploadRejected(
            ErrorKind.TOO_LARGE, f"wheel {path.name} is too large to vendor: {exc}"
        ) from None
    except archive.ArchiveError as exc:
        raise UploadRejected(
            ErrorKind.UPSTREAM_FAILED, f"wheel {path.name} is unreadable or unsafe: {exc}"
        ) from None
    return Wheel(path.name, canonicalize_name(name), files)


def _install_path(name: str) -> str | None:
    """Where a wheel member lands under vendor/ (None: not importable, left out).

    ``<dist>.data/purelib`` and ``platlib`` install at the root like pip does; the
    wheel's scripts, headers and data files are not code a task imports.
    """
    top, _, rest = name.partition("/")
    if top.endswith(".data") and rest:
        scheme, _, inner = rest.partition("/")
        return inner if scheme in ("purelib", "platlib") and inner else None
    return name


def _module_key(top: str) -> str:
    """``msgpack`` for ``msgpack/``, ``six.py`` and ``_cffi_backend.cpython-311-….so`` alike."""
    if top.endswith((".py", *EXTENSION_SUFFIXES)):
        return top.split(".", 1)[0]
    return top


def _dist_info_name(top: str) -> str | None:
    if top.endswith((".dist-info", ".data")):
        return canonicalize_name(top.rsplit(".", 1)[0].split("-", 1)[0])
    return None


def vendor_wheels(members: dict[str, bytes], wheels: list[Wheel]) -> dict[str, bytes]:
    """``members`` with the wheels' files under vendor/.

    A wheel's top-level modules replace same-named entries already in vendor/ (for
    instance the host build's compiled copy of the same dependency), as does its
    dist-info any older dist-info of that distribution; everything else is kept.
    """
    installed: dict[str, bytes] = {}
    for wheel in wheels:  # sorted by file name: a later wheel overwrites, like pip install
        for name, data in wheel.files.items():
            path = _install_path(name)
            if path is not None:
                installed[path] = data
    modules = {_module_key(path.split("/", 1)[0]) for path in installed}
    dists = {wheel.name for wheel in wheels}
    prefix = VENDOR_DIR + "/"
    kept: dict[str, bytes] = {}
    for name, data in members.items():
        if name.startswith(prefix):
            top = name[len(prefix) :].split("/", 1)[0]
            if _module_key(top) in modules or _dist_info_name(top) in dists:
                continue
        kept[name] = data
    kept.update({posixpath.join(VENDOR_DIR, path): data for path, data in installed.items()})
    return kept


@dataclass(frozen=True)
class BuildInput:
    """What a build needs from the database, read before pip runs (so none is held then)."""

    package: WorkflowPackage
    members: dict[str, bytes]
    requirements: list[str]


def prepare_build(tenant: Tenant, name: str, version: str, target_triple: str) -> BuildInput:
    """Check that ``name`` ``version`` can be built for ``target_triple`` and read its
    primary build; raises :class:`UploadRejected` (404/422) naming the problem."""
    platform_tags(target_triple)  # refuses a bad or unsupported triple before any lookup
    package = find_package(tenant, name, version)
    if package is None:
        raise UploadRejected(ErrorKind.NOT_FOUND, f"package {name} version {version} not found")
    if package.kind != PackageKind.NATIVE:
        raise UploadRejected(
            ErrorKind.INVALID,
            f"{name} {package.version} is a python package: it runs from source on any agent "
            "and takes no per-target builds",
        )
    members = archive.read_members(load_blob(package.digest))
    if REQUIREMENTS_FILE not in members:
        raise UploadRejected(
            ErrorKind.INVALID,
            f"{name} {package.version} has no top-level {REQUIREMENTS_FILE}: nothing to vendor "
            f"for {target_triple}; upload the build with POST "
            f"/packages/{name}/{package.version}/artifacts instead",
        )
    try:
        text = members[REQUIREMENTS_FILE].decode("utf-8")
    except UnicodeDecodeError:
        raise UploadRejected(ErrorKind.INVALID, f"{REQUIREMENTS_FILE} is not UTF-8 text") from None
    return BuildInput(package, members, parse_requirements(text))


def vendored_archive(
    build: BuildInput,
    target_triple: str,
    *,
    meter: DownloadMeter | None = None,
    stop: threading.Event | None = None,
) -> bytes:
    """The canonical archive of ``build`` with its wheels for ``target_triple`` vendored.
    Touches no database; raises :class:`UploadRejected` or :class:`BuildInterrupted`."""
    with tempfile.TemporaryDirectory(prefix="cloacina-wheels-") as tmp:
        dest = Path(tmp) / "wheels"
        dest.mkdir()
        paths = download_wheels(build.requirements, target_triple, dest, meter=meter, stop=stop)
        wheels = [read_wheel(path, target_triple) for path in paths]
    built = canonical_archive(vendor_wheels(build.members, wheels))
    limit = get_config().max_package_bytes
    if len(built) > limit:
        package = build.package
        raise UploadRejected(
            ErrorKind.TOO_LARGE,
            f"the vendored build of {package.name} {package.version} for {target_triple} is "
            f"{len(built)} bytes; the limit is {limit} (CLOACINA_MAX_PACKAGE_BYTES)",
        )
    return built


def build_target(
    tenant: Tenant, name: str, version: str, target_triple: str
) -> tuple[PackageArtifact, bool]:
    """Build and publish the per-target artifact of ``name`` ``version`` for ``target_triple``
    in the calling thread (the REST endpoint queues a job instead: artifacts/builds/jobs.py);
    returns ``(artifact, created)``."""
    build = prepare_build(tenant, name, version, target_triple)
    built = vendored_archive(build, target_triple)
    package = build.package
    return publish_target_artifact(tenant, package.name, package.version, target_triple, built)


def build_target_artifact(
    tenant: Tenant, name: str, version: str, target_triple: str
) -> PackageArtifact:
    """The per-target artifact for ``target_triple``, built by vendoring wheels (or the
    identical one already stored). Raises :class:`UploadRejected` with its kind."""
    return build_target(tenant, name, version, target_triple)[0]
