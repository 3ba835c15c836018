"""The build step that vendors platform wheels (artifacts/store/wheels.py, POST .../builds,
run as a background job: artifacts/builds/jobs.py, artifacts/builds/runner.py).

Most tests run the real ``pip download`` against a local find-links directory of
wheels built here (no index, no operator pip config), so they are fast and offline;
the ``network`` test fetches a real compiled wheel from the package index.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_packages_wheels.py.
"""

from __future__ import annotations

import re

import pytest

from artifacts.store import wheels
from artifacts.store.services import UploadRejected
from fleet.api.error_status import http_status
from tests.support.packages import (
    ARM,
    ARM_SO,
    HOST_SO,
    X86,
)


def test_linux_triples_map_to_manylinux_tags_only():
    x86 = wheels.platform_tags(X86)
    assert {"manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux1_x86_64"} <= set(x86)
    assert x86[0] == f"manylinux_2_{wheels.MANYLINUX_MAX_GLIBC_MINOR}_x86_64"
    assert all(t.startswith("manylinux") and t.endswith("_x86_64") for t in x86)
    arm = wheels.platform_tags(ARM)
    assert {"manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"} <= set(arm)
    assert all(t.endswith("_aarch64") for t in arm) and "manylinux_2_16_aarch64" not in arm
    assert wheels.platform_tags("aarch64-unknown-linux-musl")[0] == "musllinux_1_2_aarch64"


@pytest.mark.parametrize(
    "triple, problem",
    [
        ("aarch64-apple-darwin", "no wheel platform is known"),
        ("riscv64gc-unknown-linux-gnu", "no wheel platform is known"),
        ("x86_64-linux", "malformed target triple"),
        ("m68k-unknown-linux-gnu", "unknown architecture"),
    ],
)
def test_other_triples_are_a_422(triple, problem):
    with pytest.raises(UploadRejected, match=problem) as info:
        wheels.platform_tags(triple)
    assert http_status(info.value) == 422


def test_it_reads_plain_requirement_lines():
    text = (
        "# pinned\n"
        "msgpack==1.2.4  # fast\n"
        "\n"
        "attrs >=23 ; python_version >= '3.8'\n"
        "cffi==1.17.1 \\\n"
        "    --hash=sha256:ABCDEF01 \\\n"
        "    --hash sha256:abcdef02\n"
    )
    assert wheels.parse_requirements(text) == [
        "msgpack==1.2.4",
        "attrs >=23 ; python_version >= '3.8'",
        "cffi==1.17.1 --hash=sha256:ABCDEF01 --hash=sha256:abcdef02",
    ]


@pytest.mark.parametrize(
    "text, problem",
    [
        ("--index-url https://evil.example/simple\nfoo\n", "line 1: option '--index-url'"),
        ("foo\n-r /etc/passwd\n", "line 2: option '-r'"),
        ("-e .\n", "option '-e'"),
        ("foo --find-links=/tmp\n", "option '--find-links'"),
        ("foo==${SECRET_KEY}\n", "'$' is not allowed"),
        ("foo @ https://example.com/foo.whl\n", "direct URL references"),
        ("foo==1.0 --hash=md5:abc\n", "option '--hash'"),
        ("not a requirement!\n", "line 1: invalid requirement"),
        ("# nothing\n\n", "lists no requirements"),
    ],
)
def test_it_refuses_options_urls_and_garbage(text, problem):
    with pytest.raises(UploadRejected, match=re.escape(problem)) as info:
        wheels.parse_requirements(text)
    assert http_status(info.value) == 422


def test_vendoring_replaces_host_copies_and_keeps_the_rest():
    primary = {
        "cloacina.toml": b"toml",
        "workflow/demo/steps.py": b"src",
        "vendor/mylib.py": b"tenant's own code",
        f"vendor/{HOST_SO}": b"x86 build",
        "vendor/fakeext/old.py": b"stale module of the host copy",
        "vendor/fakeext-0.9.dist-info/METADATA": b"old",
        "vendor/fakedep.py": b"old fakedep",
    }
    wheel = wheels.Wheel(
        "fakeext-1.0-…whl",
        "fakeext",
        {
            "fakeext/__init__.py": b"",
            ARM_SO: b"arm build",
            "fakeext-1.0.dist-info/METADATA": b"new",
            "fakeext-1.0.data/platlib/fakeext_plat.py": b"platlib",
            "fakeext-1.0.data/headers/fakeext.h": b"not code",
        },
    )
    dep = wheels.Wheel("fakedep-…whl", "fakedep", {"fakedep-1.0.data/purelib/fakedep.py": b"new"})
    out = wheels.vendor_wheels(primary, [dep, wheel])
    assert out == {
        "cloacina.toml": b"toml",
        "workflow/demo/steps.py": b"src",
        "vendor/mylib.py": b"tenant's own code",
        "vendor/fakeext/__init__.py": b"",
        f"vendor/{ARM_SO}": b"arm build",
        "vendor/fakeext-1.0.dist-info/METADATA": b"new",
        "vendor/fakeext_plat.py": b"platlib",
        "vendor/fakedep.py": b"new",
    }
