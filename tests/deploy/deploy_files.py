"""Helpers of the tests of deploy/: load a generator script from deploy/ as a module, and find promtool."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def load_script(relative: str) -> ModuleType:
    """deploy/<relative> (a script, not a package module) imported under a private name."""
    path = DEPLOY / relative
    spec = importlib.util.spec_from_file_location(f"_deploy_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def require_module(name: str, install: str) -> None:
    """Skip without `name` outside CI; in CI (CI set, as .ci/run runs) the test extra installs it, so fail."""
    if importlib.util.find_spec(name) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: {install}")
        pytest.skip(f"{name} is not installed ({install})")


def promtool() -> str:
    """promtool's path. scripts/setup.sh installs Debian's prometheus package (promtool with it) where it runs as
    root: in CI a missing promtool fails the test instead of skipping it."""
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: scripts/setup.sh installs Debian's prometheus package")
        pytest.skip("promtool not found (apt-get install prometheus; scripts/setup.sh does it as root)")
    return found
