"""Packages for the API tests: archives (valid, native, hostile), the upload and build
calls a client makes, wheels and the local find-links index pip resolves them from; and
the validation limits and memory reading the package-validation tests share."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import psutil
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from agents.sandbox import archive
from artifacts.builds.runner import BuildRunner
from artifacts.store.testing import build_archive, manifest_toml, package_files, parse_bomb
from artifacts.store.validation import ValidationLimits
from tests.support.keys import bearer

ARM = "aarch64-unknown-linux-gnu"


T = {"id": "a", "function": "demo.steps:a"}


def upload(client: Client, key: str, data: bytes, name: str = "pkg.tar.gz"):
    return client.post("/api/v1/packages", {"file": SimpleUploadedFile(name, data)}, **bearer(key))


def upload_target(client, key, data, triple=ARM, name="demo", version="1.0.0", **extra):
    return client.post(
        f"/api/v1/packages/{name}/{version}/artifacts",
        {"file": SimpleUploadedFile("t.tar.gz", data), "target_triple": triple, **extra},
        **bearer(key),
    )


def native(version: str = "1.0.0", marker: str = "", **manifest) -> bytes:
    files = package_files(kind="native", version=version, **manifest)
    files["workflow/demo/native.txt"] = marker
    return build_archive(files)


def bad_tar(*entries: tuple[str, bytes, str]) -> bytes:
    """entries: (name, data, linkname-or-type) — linkname 'sym:x' / 'hard:x' makes a link."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data, link in entries:
            info = tarfile.TarInfo(name)
            if link.startswith("sym:"):
                info.type, info.linkname = tarfile.SYMTYPE, link[4:]
            elif link.startswith("hard:"):
                info.type, info.linkname = tarfile.LNKTYPE, link[5:]
            info.size = 0 if link else len(data)
            tar.addfile(info, None if link else io.BytesIO(data))
    return out.getvalue()


def with_valid(*extra: tuple[str, bytes, str]) -> bytes:
    files = [(k, v.encode(), "") for k, v in package_files().items()]
    return bad_tar(*files, *extra)


def many_members() -> bytes:
    files: dict[str, str | bytes] = dict(package_files())
    files.update({f"vendor/f{i}.txt": "" for i in range(archive.MAX_MEMBERS)})
    return build_archive(files, "zip")


def manifest_case(text: str) -> bytes:
    files = package_files()
    files["cloacina.toml"] = text
    return build_archive(files)


CYCLE = [
    {"id": "a", "function": "demo.steps:a", "dependencies": ["b"]},
    {"id": "b", "function": "demo.steps:b", "dependencies": ["a"]},
]


BAD_UPLOADS = {
    "dotdot": (lambda: with_valid(("../evil.py", b"x", "")), 400, "'..'"),
    "absolute": (lambda: with_valid(("/etc/cron.d/evil", b"x", "")), 400, "absolute path"),
    "symlink-out": (
        lambda: with_valid(("workflow/x", b"", "sym:../../etc/passwd")),
        400,
        "symlink 'workflow/x' -> '../../etc/passwd' points outside the package",
    ),
    "hardlink-out": (
        lambda: with_valid(("workflow/y", b"", "hard:../secret")),
        400,
        "hardlink 'workflow/y' -> '../secret' points outside the package",
    ),
    "not-an-archive": (lambda: b"just some text", 400, "not a .tar.gz or .zip"),
    "member-count": (many_members, 400, f"more than {archive.MAX_MEMBERS} members"),
    "no-manifest": (
        lambda: build_archive({"workflow/demo/steps.py": "x = 1"}),
        422,
        "cloacina.toml not found",
    ),
    "bad-toml": (lambda: manifest_case("[package\nname="), 422, "not valid TOML"),
    "bad-name": (
        lambda: manifest_case(manifest_toml([T], name="Demo!")),
        422,
        "package.name 'Demo!'",
    ),
    "bad-version": (
        lambda: manifest_case(manifest_toml([T], version="one")),
        422,
        "package.version 'one'",
    ),
    "duplicate-ids": (
        lambda: manifest_case(manifest_toml([T, T])),
        422,
        "duplicate task id 'a'",
    ),
    "unknown-dependency": (
        lambda: manifest_case(manifest_toml([{**T, "dependencies": ["ghost"]}])),
        422,
        "tasks[0] (id 'a'): dependency 'ghost' is not a task",
    ),
    "cycle": (lambda: manifest_case(manifest_toml(CYCLE)), 422, "dependency cycle: a -> b -> a"),
    "missing-module": (
        lambda: manifest_case(manifest_toml([{"id": "a", "function": "demo.gone:a"}])),
        422,
        "tasks[0] (id 'a'): module 'demo.gone' not found",
    ),
    "missing-function": (
        lambda: manifest_case(manifest_toml([{"id": "a", "function": "demo.steps:zz"}])),
        422,
        "tasks[0] (id 'a'): function 'zz' is not defined at the top level of workflow/demo/steps.py",
    ),
    "unknown-key": (
        lambda: manifest_case(manifest_toml([{**T, "timeout": 5}])),
        422,
        "unknown key 'timeout' in tasks[0] (id 'a')",
    ),
    "bad-trigger-rule": (
        lambda: manifest_case(manifest_toml([{**T, "trigger_rule": "any"}])),
        422,
        "tasks[0] (id 'a'): trigger_rule must be one of all_success, all_done, one_failed",
    ),
    "negative-retries": (
        lambda: manifest_case(manifest_toml([{**T, "retries": -2}])),
        422,
        "tasks[0] (id 'a'): retries must be an integer >= 0, got -2",
    ),
    # 4 MB of source in ~6 KB: refused before ast.parse (it cost the server 1.6 GB).
    "parse-bomb": (
        parse_bomb,
        413,
        "a task module may have at most 1048576 (CLOACINA_MAX_MODULE_SOURCE_BYTES)",
    ),
}


X86 = "x86_64-unknown-linux-gnu"


ARM_SO = "fakeext/_native.cpython-311-aarch64-linux-gnu.so"


HOST_SO = "fakeext/_native.cpython-311-x86_64-linux-gnu.so"


def make_wheel(directory: Path, filename: str, files: dict[str, bytes], requires=()) -> Path:
    """A minimal valid wheel (zip with dist-info) that pip can resolve from find-links."""
    name, version = filename.split("-")[:2]
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    path = directory / filename
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist_info}/METADATA", metadata)
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return path


def native_with_requirements(requirements: str | None, **extra: str | bytes) -> bytes:
    files = package_files(kind="native")
    if requirements is not None:
        files["requirements.txt"] = requirements
    files.update(extra)
    return build_archive(files)


def build(client: Client, key: str, triple: str = ARM, name: str = "demo", version: str = "1.0.0"):
    return client.post(
        f"/api/v1/packages/{name}/{version}/builds",
        json.dumps({"target_triple": triple}),
        content_type="application/json",
        **bearer(key),
    )


def run_builds() -> int:
    return BuildRunner("test-server").run_pending()


def status(client: Client, key: str, queued) -> dict:
    url = queued.json()["status_url"] if hasattr(queued, "json") else queued
    response = client.get(url, **bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """fakeext 1.0 (aarch64 only, depends on fakedep) and fakedep 1.0 (pure) as the only index."""
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(
        links,
        "fakeext-1.0-cp311-cp311-manylinux2014_aarch64.whl",
        {"fakeext/__init__.py": b"", ARM_SO: b"\x7fELF arm", "fakeext-1.0.data/scripts/x": b""},
        requires=["fakedep"],
    )
    make_wheel(
        links,
        "fakedep-1.0-py3-none-any.whl",
        {"fakedep-1.0.data/purelib/fakedep.py": b"X = 1\n"},
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no operator index, mirror or constraints
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


MB = 1024 * 1024


def limits(**overrides) -> ValidationLimits:
    """Validation limits of 1 MB per manifest and module, 5,000 tasks and a 256 MB parsing
    child, with ``overrides`` on top."""
    base = {
        "max_manifest_bytes": MB,
        "max_module_source_bytes": MB,
        "max_tasks": 5000,
        "memory_bytes": 256 * MB,
    }
    return ValidationLimits(**(base | overrides))


def rss_mb() -> float:
    """This test process's resident memory, in MB."""
    return psutil.Process().memory_info().rss / MB
