"""relax-train's Ctrl-C/SIGTERM handler: the first asks for a checkpoint, a second stops."""

from __future__ import annotations

import signal

import pytest

from relax_slurm.runtime.control import preempt_requested
from relax_slurm.launch.interrupt import GracefulStop, kept_message, stopped_message


def test_first_signal_asks_for_a_checkpoint_the_second_stops_at_once(tmp_path, capsys):
    stop = GracefulStop()
    stop.arm(tmp_path)
    stop(signal.SIGINT, None)
    assert preempt_requested(tmp_path)
    assert "Ctrl-C again stops at once" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGTERM, None)


def test_before_the_roles_run_a_signal_stops_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        GracefulStop()(signal.SIGINT, None)
    assert not preempt_requested(tmp_path)


def test_without_a_checkpoint_it_says_the_run_starts_over(tmp_path):
    assert "starts again from step 0" in kept_message(["experiment=tiny_cpu"], tmp_path)


def test_one_signal_during_start_up_does_not_read_as_two(tmp_path):
    (tmp_path / "logs").mkdir()  # start-up had begun: the run directory exists, no checkpoint
    msg = stopped_message(["experiment=tiny_cpu"], tmp_path, pressed_twice=False)
    assert "during start-up" in msg and "starts again from step 0" in msg
    assert "not two" not in msg and "again" not in msg.splitlines()[0]
    twice = stopped_message(["experiment=tiny_cpu"], tmp_path, pressed_twice=True)
    assert "interrupted again" in twice and "one Ctrl-C, not two" in twice
