"""`relax-train`: compose the config with Hydra, validate it, run it (or submit it to Slurm).

    relax-train experiment=tiny_cpu run_dir=runs/demo algo.max_staleness=2
    relax-train experiment=tiny_cpu cluster=slurm cluster.partition=gpu [cluster.wait=true]
    relax-train -m experiment=tiny_cpu trainer.lr=1e-5,3e-5      # a sweep (launch/sweep.py)

Hydra runs here only; every role reads the resolved `run_dir/config.yaml`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from relax_slurm.config import register_configs, to_train_config
from relax_slurm.config.cluster import SlurmClusterConfig
from relax_slurm.config.load import check_override_keys
from relax_slurm.errors import ConfigError, Preempted, RelaxError
from relax_slurm.config.variants import check_cluster_overrides
from relax_slurm.launch.choices import check_group_choices, check_hydra_dirs
from relax_slurm.launch.compose import CONF_DIR, composed_kind
from relax_slurm.launch.help import HELP_FLAGS, doc_ref, help_text
from relax_slurm.launch.interrupt import STOP, kept_message, stopped_message
from relax_slurm.launch.launcher_log import LAUNCHER_LOG, tee_output
from relax_slurm.launch.sweep import Sweep, fixed_keys, in_multirun, is_multirun, point_name
from relax_slurm.tiny.assets import ensure_tiny_assets

SWEEP = Sweep()  # the points of `relax-train -m`, in the order Hydra runs them

def discard_if_unused(run_dir: Path) -> None:
    """Hydra makes run_dir (and its .hydra/) before the config is validated, relax-train its
    launcher.log: a run refused before it started must not leave a directory that looks like
    a run."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", LAUNCHER_LOG}:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run(cfg: DictConfig) -> None:
    if in_multirun():
        _run_point(cfg)
        return
    run_dir = Path(cfg.get("run_dir") or ".").resolve()
    local = OmegaConf.select(cfg, "cluster.kind") == "local"  # Slurm's: the job's --output
    with tee_output(run_dir / LAUNCHER_LOG) if local else contextlib.nullcontext():
        _run_one(cfg, run_dir)


def _run_one(cfg: DictConfig, run_dir: Path) -> None:
    try:
        train_cfg = to_train_config(cfg)
        slurm = train_cfg.cluster if isinstance(train_cfg.cluster, SlurmClusterConfig) else None
        if not (slurm and slurm.dry_run):  # a tiny preset on a fresh machine: its model, data
            ensure_tiny_assets(train_cfg)
        if slurm:
            from relax_slurm.launch.sbatch import run_sbatch

            code = run_sbatch(train_cfg)
            if slurm.dry_run:  # it says nothing was written: not even Hydra's .hydra/
                discard_if_unused(run_dir)
            sys.exit(code)
        from relax_slurm.launch.local import run_local

        summary = run_local(train_cfg)
        if summary is None:  # complete already: nothing ran, its summary.json is kept
            return
    except Preempted as e:
        if not STOP.requested:  # not our Ctrl-C: a preemption request of its own
            print(f"relax-train: error: {e}", file=sys.stderr)
            sys.exit(1)
        print("relax-train: interrupted: the trainer saved a checkpoint and every process of "
              f"the run was stopped\n{kept_message(sys.argv[1:], run_dir)}", file=sys.stderr)
        sys.exit(130)
    except RelaxError as e:
        discard_if_unused(run_dir)
        print(f"relax-train: error: {e}", file=sys.stderr)
        if STOP.requested:  # failed while stopping on a Ctrl-C: what is there to resume from
            print(kept_message(sys.argv[1:], run_dir), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        discard_if_unused(run_dir)  # stopped before anything started
        print(stopped_message(sys.argv[1:], run_dir, pressed_twice=STOP.requested),
              file=sys.stderr)
        sys.exit(130)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {Path(train_cfg.run_dir).resolve()}")


def _run_point(cfg: DictConfig) -> None:
    """One point of `relax-train -m`: its own run directory (Hydra's output directory for
    it); an error is recorded in SWEEP and the sweep goes on (no sys.exit here: Hydra's
    launcher would end the whole multirun)."""
    point = SWEEP.begin()
    print(f"relax-train: sweep point #{point.num} ({point.overrides}): {point.run_dir}",
          file=sys.stderr, flush=True)
    try:
        train_cfg = to_train_config(cfg)
        train_cfg.run_dir = point.run_dir
        slurm = train_cfg.cluster if isinstance(train_cfg.cluster, SlurmClusterConfig) else None
        if not (slurm and slurm.dry_run):
            ensure_tiny_assets(train_cfg)
        if slurm:
            from relax_slurm.launch.sbatch import submit_run

            point.job_id = submit_run(train_cfg)  # the next point is submitted at once
            point.state = ("submitted" if point.job_id is not None
                           else "dry run" if slurm.dry_run else "complete already")
            if point.job_id is not None and slurm.wait:
                SWEEP.waiting.append((point, slurm.wait_poll_s))
            return
        from relax_slurm.launch.local import run_local

        summary = run_local(train_cfg)
    except Preempted as e:  # our Ctrl-C kept a checkpoint: the sweep ends here
        point.state = "interrupted"
        if not STOP.requested:
            point.state, point.message = "failed", str(e)
            return
        print(kept_message(sys.argv[1:], Path(point.run_dir)), file=sys.stderr)
        raise KeyboardInterrupt from e
    except RelaxError as e:
        point.state, point.message = "failed", str(e)
        print(f"relax-train: error in sweep point #{point.num}: {e}", file=sys.stderr, flush=True)
        return
    except KeyboardInterrupt:
        point.state = "interrupted"
        raise  # Ctrl-C ends the sweep: main prints what ran
    point.state = "completed"
    if summary is not None:  # None: complete already, nothing ran
        print(json.dumps(summary, indent=2))


def _finish_sweep() -> int:
    """After the last point: wait for Slurm jobs (cluster.wait=true), print the table, write
    sweep.json; exit status 1 if any point failed."""
    if not SWEEP.points:  # `-m --cfg job` and the like: Hydra printed, nothing ran
        return 0
    try:
        SWEEP.wait_jobs()
    except KeyboardInterrupt:
        print("stopped waiting; the sweep's jobs keep running (`scancel` stops them)",
              flush=True)
    except RelaxError as e:
        print(f"relax-train: error: {e}", file=sys.stderr)
    print(SWEEP.table(), flush=True)
    SWEEP.write()
    return SWEEP.exit_code()


USAGE = """usage: relax-train experiment=NAME [key=value ...]     \
(Hydra overrides; --help lists all)

  relax-train experiment=tiny_cpu run_dir=runs/tiny      the embedded CPU default (builds its
                                                         tiny model and data on first use)
  relax-train experiment=tiny_cpu cluster=slurm          the same as a Slurm heterogeneous job

experiments: {experiments}
docs: {docs}"""


def usage() -> str:
    """What a bare `relax-train` prints: with no experiment the base config would train 100
    steps of nothing (lr 1e-6, 256-token answers), so it names the presets instead."""
    names = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    return USAGE.format(experiments=", ".join(names),
                        docs=doc_ref("quickstart.md", "configuration.md"))


def main() -> None:
    # SIGTERM (kill) takes the same path as Ctrl-C (launch/interrupt.py): the first keeps a
    # checkpoint once the roles run, a second stops them at once (children stopped in finally)
    signal.signal(signal.SIGTERM, STOP)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # nohup / `&` keep it ignored
        signal.signal(signal.SIGINT, STOP)
    if len(sys.argv) == 1:
        print(usage(), file=sys.stderr)
        sys.exit(2)
    try:  # before Hydra, whose advice for a misspelt key is to add it with `+`
        check_override_keys(sys.argv[1:])
        check_hydra_dirs(sys.argv[1:])
        if not any(a.startswith("--config-dir") for a in sys.argv[1:]):  # else: configs of
            check_group_choices(sys.argv[1:], CONF_DIR)  # the user's, not composed here
            check_cluster_overrides(sys.argv[1:], composed_kind)
    except RelaxError as e:
        print(f"relax-train: error: {e}", file=sys.stderr)
        sys.exit(1)
    if not (CONF_DIR / "train.yaml").is_file():
        sys.exit(f"relax-train: {CONF_DIR}/train.yaml not found: the package was installed "
                 "without its configs; reinstall it (pip install relax-slurm, or pip install . "
                 "from a source checkout)")
    register_configs()
    args = sys.argv[1:]
    if any(a in HELP_FLAGS for a in args) and not any(a.startswith("--config-dir") for a in args):
        print(help_text(CONF_DIR, [a for a in args if a not in HELP_FLAGS]))  # no base_* choices
        return
    OmegaConf.register_new_resolver("relax_point", point_name, replace=True)
    multirun = is_multirun(args)
    if multirun:
        try:
            # next to the user's overrides: Hydra's parser wants them in one run (--cfg job after)
            at = next((i for i, a in enumerate(sys.argv) if i and "=" in a
                       and not a.startswith("-")), len(sys.argv))
            sys.argv[at:at] = sweep_overrides(args)
        except RelaxError as e:
            print(f"relax-train: error: {e}", file=sys.stderr)
            sys.exit(1)
    try:
        hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(_run)()
    except KeyboardInterrupt:
        if not multirun:
            raise
        print("relax-train: sweep interrupted; every process of the running point was stopped",
              file=sys.stderr)
        _finish_sweep()
        sys.exit(130)
    if multirun:
        sys.exit(_finish_sweep())


def sweep_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides a sweep adds: point directories named by the swept keys only."""
    fixed = fixed_keys(argv)
    if "run_dir" in {a.split("=", 1)[0] for a in argv} - set(fixed):
        raise ConfigError("run_dir cannot be swept: in `relax-train -m` it names the sweep's "
                          "directory, and each point runs in run_dir/<num>_<swept values>")
    if any(a.startswith("hydra.job.config.override_dirname.exclude_keys=") for a in argv):
        return []  # the user chose what names a point
    return [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(fixed)}]"]


if __name__ == "__main__":
    main()
