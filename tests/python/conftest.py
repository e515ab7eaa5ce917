"""Shared fixtures: the shoal binary built by `make`, and a scratch directory."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shoal_bin() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("SHOAL_BIN", ROOT / "target" / "release" / "shoal"))
    if not path.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "shoal"], cwd=ROOT, check=True)
    return path
