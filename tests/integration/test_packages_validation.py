"""Package format, archive safety, manifest rules and the build step (no HTTP, mostly no DB).

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_packages_validation.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from artifacts.store.build import canonical_archive
from artifacts.store.testing import (
    build_archive,
    example_archive,
    manifest_toml,
    package_files,
    parse_bomb,
)
from artifacts.store.validation import PackageError, PackageLimitError, validate_package
from tests.support.packages import MB, limits, rss_mb
from tests.support.processes import REPO


def test_the_runtime_modules_import_no_django():
    code = (
        "import sys, agents.sandbox.archive, agents.protocol.triples; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('django', 'artifacts', 'fleet')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


T = {"id": "a", "function": "m:f"}


def test_the_example_package_validates():
    package = validate_package(example_archive())
    assert package.name == "etl-demo" and package.workflow_name == "etl"
    assert package.task_names == ["extract", "transform_a", "transform_b", "load"]
    extract = package.manifest["tasks"][0]
    assert extract["retries"] == 2 and extract["retry_backoff_s"] == 0.2


def test_it_accepts_a_single_wrapping_directory():
    files = {f"demo-1.0/{k}": v for k, v in package_files().items()}
    assert validate_package(build_archive(files)).task_names == ["a", "b"]


def test_it_finds_functions_in_vendor_packages_assignments_and_imports():
    files = package_files(
        tasks=[
            {"id": "a", "function": "lib.tools:helper"},
            {"id": "b", "function": "demo.steps:b"},
            {"id": "c", "function": "demo.steps:c"},
        ],
        source="from lib.tools import helper as b\nc = b\n",
    )
    files["vendor/lib/tools/__init__.py"] = "async def helper(ctx):\n    pass\n"
    assert validate_package(build_archive(files)).task_names == ["a", "b", "c"]


def test_it_never_imports_tenant_code(tmp_path):
    marker = tmp_path / "imported"
    source = f"open({str(marker)!r}, 'w').close()\ndef a(c):\n    pass\ndef b(c):\n    pass\n"
    validate_package(build_archive(package_files(source=source)))
    assert not marker.exists()


@pytest.mark.parametrize(
    "files, problem",
    [
        ({"workflow/x.py": ""}, "cloacina.toml not found"),
        ({"cloacina.toml": manifest_toml([T])}, "workflow/ directory"),
        (
            package_files(tasks=[{"id": "a", "function": "demo.missing:a"}]),
            "module 'demo.missing' not found",
        ),
        (
            package_files(tasks=[{"id": "a", "function": "demo.steps:nope"}]),
            "tasks[0] (id 'a'): function 'nope' is not defined",
        ),
        (package_files(source="def a(:\n"), "workflow/demo/steps.py: syntax error at line 1"),
    ],
)
def test_it_names_the_package_problem(files, problem):
    with pytest.raises(PackageError) as excinfo:
        validate_package(build_archive(files))
    assert problem in str(excinfo.value)


def test_a_nested_function_does_not_count():
    source = "def outer(c):\n    def a(c):\n        pass\n\ndef b(c):\n    pass\n"
    with pytest.raises(PackageError, match="function 'a' is not defined"):
        validate_package(build_archive(package_files(source=source)))


def test_the_build_is_deterministic_across_formats_and_order():
    files = package_files()
    as_tar = validate_package(build_archive(files)).members
    as_zip = validate_package(build_archive(dict(reversed(files.items())), "zip")).members
    assert canonical_archive(as_tar) == canonical_archive(as_zip)


def test_a_bomb_under_the_size_limit_runs_out_of_the_parsing_childs_memory_not_ours():
    """The source limit raised past the bomb: it reaches ``ast.parse``, in the child process
    capped at ``memory_bytes``. RSS measured: of this test process, around the call."""
    data = parse_bomb()
    before = rss_mb()
    with pytest.raises(PackageLimitError, match=re.escape(
        "workflow/demo/steps.py: parsing it needs more than 268435456 bytes of memory "
        "(CLOACINA_VALIDATION_MEMORY_BYTES)"
    )):  # fmt: skip
        validate_package(data, limits(max_module_source_bytes=8 * MB))
    grown = rss_mb() - before
    print(f"\nparse bomb in the capped child: test process RSS +{grown:.1f} MB")
    assert grown < 100


def test_the_child_still_finds_functions_and_names_syntax_errors():
    files = package_files()
    files["workflow/demo/other.py"] = "def c(context):\n    return None\n\ndef broken(:\n"
    files["cloacina.toml"] = manifest_toml(
        [{"id": "a", "function": "demo.steps:a"}, {"id": "c", "function": "demo.other:c"}]
    )
    with pytest.raises(PackageError, match=r"workflow/demo/other.py: syntax error at line 4"):
        validate_package(build_archive(files), limits())
    nested = package_files(source="def a(context):\n    return " + "(" * 300 + ")" * 300 + "\n")
    with pytest.raises(PackageError, match="too many nested parentheses"):
        validate_package(build_archive(nested), limits())


def test_more_tasks_than_the_limit_are_refused():
    tasks = [{"id": f"t{i}", "function": "demo.steps:a"} for i in range(5001)]
    with pytest.raises(PackageError) as refused:
        validate_package(build_archive(package_files(tasks)))
    assert isinstance(refused.value, PackageLimitError)
    assert str(refused.value) == (
        "the workflow has 5001 tasks; the limit is 5000 (CLOACINA_MAX_TASKS)"
    )
    with pytest.raises(PackageLimitError, match="has 3 tasks; the limit is 2"):
        validate_package(build_archive(package_files(tasks[:3])), limits(max_tasks=2))
    assert validate_package(build_archive(package_files(tasks[:2])), limits(max_tasks=2))
