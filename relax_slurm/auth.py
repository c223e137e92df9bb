"""The run's secret: one random token per run directory that every request to the broker (ZMQ
and admin HTTP) must carry.

The launcher creates it (`ensure_secret`) in `RUN_DIR/secret`, readable by its owner only
(0600), and hands it to every role in the environment variable `RELAX_RUN_SECRET`; roles read
it through `run_secret()` (the only read of that variable). A user or a tool on the same
account reads the file (`relax_slurm.auth.read_secret(RUN_DIR)` or `cat RUN_DIR/secret`).
Comparisons are constant-time (`hmac.compare_digest`). No torch here: the broker imports it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from relax_slurm.errors import ConfigError

SECRET_ENV = "RELAX_RUN_SECRET"
SECRET_FILE = "secret"
_SECRET_BYTES = 32


def new_secret() -> str:
    return secrets.token_hex(_SECRET_BYTES)


def secret_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SECRET_FILE


def read_secret(run_dir: str | Path) -> str:
    """The secret of the run in `run_dir`; ConfigError if it is missing or readable by others."""
    path = secret_path(run_dir)
    try:
        mode = path.stat().st_mode
        value = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the run's secret {path}: {e}; relax-train writes it "
                          "when it starts the run") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is accessible to other users (mode {oct(mode & 0o777)}); "
                          f"`chmod 600 {path}`")
    if not value:
        raise ConfigError(f"{path} is empty; delete it and relax-train writes a new one")
    return value


def ensure_secret(run_dir: str | Path) -> str:
    """The run's secret, created (0600, never group- or world-readable, not even briefly) on
    first use; a restarted or requeued attempt of the same run directory keeps it."""
    path = secret_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_secret(run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    return read_secret(run_dir)


def run_secret() -> str | None:
    """The secret the launcher gave this process (None outside a run)."""
    return os.environ.get(SECRET_ENV) or None


def secret_matches(expected: str, given: object) -> bool:
    """Constant-time check of a presented token."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def bearer_matches(expected: str, header: str | None) -> bool:
    """Check an `Authorization: Bearer TOKEN` header value."""
    if not header or not header.startswith("Bearer "):
        return False
    return secret_matches(expected, header[len("Bearer "):].strip())


def logs_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/logs, created or narrowed to its owner (0700). The roles' logs may hold the
    run's secret: SGLang logs its whole server_args at start, `--api-key` included, and the
    engines' key is the secret unless RELAX_ENGINE_API_KEY is set; with the user's umask
    (0755 on most clusters) anyone who can read the run directory read it there."""
    path = Path(run_dir) / "logs"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # an existing folder (a restart, an older run) keeps its mode otherwise
    return path

