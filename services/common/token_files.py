"""Secrets in files: the internal tokens a supervisor hands its children. A token is never put in
an argv, which `ps` shows to everyone; its file is mode 0600 in a directory the caller keeps
private (mkdtemp's 0700)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from services.common.config import SecurityConfig
from services.common.rpc.security import ROLES


def write_token_file(directory: Path) -> SecurityConfig:
    """A random shared internal token in `directory`/internal-token (mode 0600; mkdtemp's directory
    is 0700), as the config that points the services at it."""
    return SecurityConfig(internal_token_file=write_secret(directory / "internal-token"))


def write_role_tokens(directory: Path) -> SecurityConfig:
    """A random token per caller role in `directory`/<role>-token (mode 0600), as the config that
    names them all: `kvmesh serve` gives each child only the ones its kind holds."""
    return SecurityConfig(**{f"{role}_token_file": write_secret(directory / f"{role}-token") for role in ROLES})


def write_secret(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path
