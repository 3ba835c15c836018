"""Test helpers: package archives from a dict of files, and published packages in the database.

``build_tar_gz`` needs no database.  ``make_package`` publishes through the
artifacts service (validation, build, blob store), exactly as an upload does.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import textwrap

MANIFEST_HEADER = """\
[package]
name = "{name}"
version = "{version}"
kind = "python"

[workflow]
name = "{workflow}"
"""


def build_tar_gz(files: dict[str, str | bytes]) -> bytes:
    """A .tar.gz of ``files`` ({path: text or bytes}); text is dedented."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, content in sorted(files.items()):
            data = content if isinstance(content, bytes) else textwrap.dedent(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def task_toml(
    task_id: str,
    function: str,
    dependencies: list[str] | None = None,
    trigger_rule: str | None = None,
    retries: int | None = None,
    retry_backoff_s: float | None = None,
    timeout_s: float | None = None,
) -> str:
    """One ``[[tasks]]`` table of a manifest."""
    lines = ["[[tasks]]", f'id = "{task_id}"', f'function = "{function}"']
    if dependencies:
        lines.append("dependencies = [" + ", ".join(f'"{d}"' for d in dependencies) + "]")
    if trigger_rule:
        lines.append(f'trigger_rule = "{trigger_rule}"')
    if retries is not None:
        lines.append(f"retries = {retries}")
    if retry_backoff_s is not None:
        lines.append(f"retry_backoff_s = {retry_backoff_s}")
    if timeout_s is not None:
        lines.append(f"timeout_s = {timeout_s}")
    return "\n".join(lines) + "\n"


def manifest(name: str, workflow: str, tasks: list[str], version: str = "1.0.0") -> str:
    """A cloacina.toml from the header fields and :func:`task_toml` tables."""
    header = MANIFEST_HEADER.format(name=name, version=version, workflow=workflow)
    return header + "\n" + "\n".join(tasks)


def package_files(
    name: str, workflow: str, tasks: list[str], modules: dict[str, str], version: str = "1.0.0"
) -> dict[str, str | bytes]:
    """Manifest plus ``modules`` ({path under workflow/: source})."""
    files: dict[str, str | bytes] = {"cloacina.toml": manifest(name, workflow, tasks, version)}
    for path, source in modules.items():
        files[f"workflow/{path}"] = source
    return files


def make_package(tenant, files: dict[str, str | bytes]):
    """Publish ``files`` as a package of ``tenant`` through the artifacts service."""
    from artifacts.services import publish_package

    package, _created = publish_package(tenant, build_tar_gz(files))
    return package


def make_tenant(name: str = "acme"):
    from fleet.models import Tenant

    return Tenant.objects.get_or_create(name=name)[0]
