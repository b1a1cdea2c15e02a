"""Which kernel library is loaded: never one planted in a folder others can write, never one whose content is
not what was built, and a library without the expected kernels means the torch paths, not a crash."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedllm.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def _planted_library(folder: Path, name: str) -> Path:
    source = folder / "planted.c"
    source.write_text(PLANTED_C)
    path = folder / name
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def compiled_objects(tmp_path_factory) -> dict[str, bytes]:
    """Source path -> its object file's bytes, filled by the first real compile of the module: every test here
    builds the library again (3 builds, ~6 s each on 2 cores), and what they check is which library gets
    loaded, installed and trusted, not the compiler, so each build after the first links the same objects."""
    return {}


@pytest.fixture
def load(monkeypatch, caplog, compiled_objects):
    """load(cache_root) -> whether `_library()` loaded a library, as a fresh process would (the library is
    loaded once per process: the cache is cleared before and after). Builds are real (objects linked into a
    fresh library, its hash recorded, installed), the objects compiled once (`compiled_objects`)."""
    monkeypatch.setenv("PAGEDLLM_NATIVE_KERNELS", "1")
    compile_all = cpu_kernels._compile_all

    def compile_once(commands: list[list[str]], timeout_s: float = 120.0) -> None:
        # each command is [cc, *flags, "-c", "-o", object, source]
        if any(cmd[-1] not in compiled_objects for cmd in commands):
            compile_all(commands, timeout_s)
            compiled_objects.update({cmd[-1]: Path(cmd[-2]).read_bytes() for cmd in commands})
        else:
            for cmd in commands:
                Path(cmd[-2]).write_bytes(compiled_objects[cmd[-1]])

    monkeypatch.setattr(cpu_kernels, "_compile_all", compile_once)

    def run(cache_root: Path) -> bool:
        monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_root))
        cpu_kernels._library.cache_clear()
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            return cpu_kernels._library() is not None

    yield run
    cpu_kernels._library.cache_clear()


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
def test_planted_library_in_a_writable_cache_is_never_loaded(tmp_path, monkeypatch, load, caplog):
    root = tmp_path / "shared-cache"
    (root / "kernels").mkdir(parents=True)
    os.chmod(root, 0o777)
    os.chmod(root / "kernels", 0o777)  # as a world-writable PAGEDLLM_CACHE_DIR lets anyone make it
    planted = _planted_library(root / "kernels", cpu_kernels._library_name())
    planted_bytes = planted.read_bytes()
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    assert load(root)  # the real kernels, built in a private folder
    assert not marker.exists(), "the planted library's constructor ran"  # before: it ran, then start-up crashed
    assert "not using the kernel cache" in caplog.text and "writable by group or others" in caplog.text
    assert planted.read_bytes() == planted_bytes  # nothing installed into the untrusted folder


@pytest.mark.slow  # tens of seconds: out of the fast run (-m "not slow"), still in CI
def test_cached_library_with_other_content_is_rebuilt(tmp_path, monkeypatch, load, caplog):
    """A private cache (this user's, mode 0700) whose library is not what was built (no recorded hash, or
    another one) is rebuilt, never loaded; the rebuilt one is loaded from the cache next time."""
    root = tmp_path / "cache"
    kernels = root / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    name = cpu_kernels._library_name()
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    for recorded in (None, "0" * 64):
        _planted_library(kernels, name)
        if recorded is not None:
            (kernels / f"{name}.sha256").write_text(recorded)
        assert load(root)
        assert not marker.exists(), f"loaded a library whose recorded hash is {recorded}"
    assert cpu_kernels._sha256(kernels / name) == (kernels / f"{name}.sha256").read_text().strip()
    caplog.clear()
    assert load(root) and "building it again" not in caplog.text  # the rebuilt one is trusted


def test_library_without_the_kernels_falls_back_to_torch(tmp_path, monkeypatch, load, caplog):
    source = tmp_path / "other.c"
    source.write_text("int not_a_kernel(void) { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [source])
    assert not load(tmp_path / "cache")  # before: AttributeError (start-up crashed)
    assert "lacks a kernel" in caplog.text and "paged_decode_attention" in caplog.text
