"""Shared fixtures: an isolated ORCHESTRATE_HOME, and no user SSH config leaking in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

pytest_plugins = ["hostlab"]


@pytest.fixture(autouse=True)
def orchestrate_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "orchestrate-home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def _no_user_ssh_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SSH_AUTH_SOCK", "")
    monkeypatch.delenv("SSH_AGENT_PID", raising=False)
    os.environ.pop("TF_CONFIG", None)
