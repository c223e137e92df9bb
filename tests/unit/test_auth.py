"""The run's secret: created 0600 once per run directory, compared in constant time."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from relax_slurm.auth import (
    SECRET_ENV, bearer_matches, ensure_secret, read_secret, run_secret, secret_matches,
    secret_path,
)
from relax_slurm.errors import ConfigError


def test_secret_is_private_random_and_kept_across_attempts(tmp_path: Path) -> None:
    first = ensure_secret(tmp_path / "run")
    assert len(first) == 64 and int(first, 16) >= 0
    assert stat.S_IMODE(secret_path(tmp_path / "run").stat().st_mode) == 0o600
    assert ensure_secret(tmp_path / "run") == first == read_secret(tmp_path / "run")
    assert ensure_secret(tmp_path / "other") != first


def test_a_readable_or_missing_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="relax-train writes it"):
        read_secret(tmp_path)
    ensure_secret(tmp_path)
    secret_path(tmp_path).chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret(tmp_path)


def test_matching(monkeypatch: pytest.MonkeyPatch) -> None:
    assert secret_matches("abc", "abc")
    assert not any(secret_matches("abc", x) for x in ("abd", "", None, 12, b"abc", "abc "))
    assert bearer_matches("abc", "Bearer abc")
    assert not any(bearer_matches("abc", h) for h in (None, "", "abc", "Bearer abd", "Basic abc"))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert run_secret() is None
    monkeypatch.setenv(SECRET_ENV, "s")
    assert run_secret() == "s"


def test_the_logs_folder_is_its_owners_only_even_when_it_existed(tmp_path):
    """SGLang logs its --api-key (the run's secret by default) in RUN_DIR/logs/engine*.log."""
    import stat

    from relax_slurm.auth import logs_dir

    (tmp_path / "logs").mkdir(mode=0o755)
    (tmp_path / "logs").chmod(0o755)
    assert stat.S_IMODE(logs_dir(tmp_path).stat().st_mode) == 0o700
    fresh = tmp_path / "new_run"
    assert stat.S_IMODE(logs_dir(fresh).stat().st_mode) == 0o700
