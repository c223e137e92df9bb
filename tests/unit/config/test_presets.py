"""Every preset under conf/ composes and validates; bad input names the key."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from relax_slurm.config import load_config, register_configs, save_config, to_train_config
from relax_slurm.errors import ConfigError
from relax_slurm.launch.help import PULLED_IN_GROUPS

CONF = Path(__file__).resolve().parents[3] / "conf"
# groups an algorithm preset pulls in (conf/algo/NAME.yaml's defaults), never chosen on the
# command line: algo_trainer/NAME.yaml is what algo=NAME sets of the trainer
PULLED_IN = set(PULLED_IN_GROUPS)
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in PULLED_IN)
PRESETS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]

register_configs()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["run_dir=/tmp/relax-test-run", *overrides])


def test_groups_are_the_documented_ones():
    assert set(GROUPS) == {"model", "algo", "rollout", "trainer", "data", "reward", "cluster",
                           "env", "experiment", "tuning"}
    assert {p.name for p in CONF.iterdir() if p.is_dir()} == set(GROUPS) | PULLED_IN


def test_algo_trainer_files_are_pulled_in_by_their_algorithm_only():
    """conf/algo_trainer/NAME.yaml belongs to algo=NAME (its defaults name it), and the algo
    group offers no `trainer/...` entry: `algo=trainer/ppo` is not an algorithm."""
    for f in sorted((CONF / "algo_trainer").glob("*.yaml")):
        assert f"/algo_trainer/{f.stem}" in (CONF / "algo" / f.name).read_text(), f.name
    assert not [p for p in (CONF / "algo").iterdir() if p.is_dir()]
    with pytest.raises(ConfigCompositionException, match="algo"):
        _compose(["algo=trainer/ppo"])


@pytest.mark.parametrize("group,name", PRESETS, ids=[f"{g}={n}" for g, n in PRESETS])
def test_every_preset_composes_and_validates(group, name):
    cfg = to_train_config(_compose([f"{group}={name}"]))
    assert cfg.run_dir == "/tmp/relax-test-run"


def test_config_roundtrip_through_run_dir_file(tmp_path):
    cfg = to_train_config(_compose(["experiment=tiny_cpu", "algo.max_staleness=2"]))
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"algo\.bogus"):
        to_train_config(_compose(["+algo.bogus=1"]))
    with pytest.raises(ConfigCompositionException, match="algo.bogus"):
        _compose(["algo.bogus=1"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigCompositionException, match="max_staleness"):
        _compose(["algo.max_staleness=soon"])


def test_cross_field_check_names_the_override():
    with pytest.raises(ConfigError, match=r"rollout\.n_samples_per_prompt"):
        to_train_config(_compose(["rollout.n_samples_per_prompt=1"]))
    with pytest.raises(ConfigError, match=r"algo\.max_staleness"):
        to_train_config(_compose(["algo.max_staleness=-1"]))
    with pytest.raises(ConfigError, match=r"weight_sync\.load_format='flat'.*flattened_bucket"):
        to_train_config(_compose(["weight_sync.load_format=flat"]))
    cfg = to_train_config(_compose(["weight_sync.load_format=flattened_bucket"]))
    assert cfg.weight_sync.load_format == "flattened_bucket"
    assert cfg.weight_sync.pause_mode == "retract"  # what every supported SGLang flushes with
    with pytest.raises(ConfigError, match=r"weight_sync\.pause_mode='nap': use retract"):
        to_train_config(_compose(["weight_sync.pause_mode=nap"]))
    # in_place: refused at launch, not when the weight-sync group forms after the engines
    # started (every sync flushes, which no supported engine does beside paused requests)
    with pytest.raises(ConfigError, match=r"weight_sync\.pause_mode=in_place: every sync "
                                          r"flushes.*use retract"):
        to_train_config(_compose(["rollout=sglang", "algo.max_staleness=1",
                                  "weight_sync.pause_mode=in_place"]))
    # sampling seeds are seed << 40 + ...: the largest must stay in int64 (SGLang checks it)
    with pytest.raises(ConfigError, match=r"seed=4194304: must be in \[0, 4194304\)"):
        to_train_config(_compose(["seed=4194304"]))
    with pytest.raises(ConfigError, match=r"seed=-1"):
        to_train_config(_compose(["seed=-1"]))
    assert to_train_config(_compose(["rollout.deterministic=true"])).rollout.deterministic


def test_a_misspelt_experiment_fails_listing_the_presets():
    # before, `optional experiment` made Hydra skip it and the default config trained
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException,
                       match=r"(?s)Could not find 'experiment/tiny_cpux'.*tiny_cpu"):
        _compose(["experiment=tiny_cpux"])


def test_a_misspelt_key_gets_the_closest_one_not_hydras_plus_advice():
    from relax_slurm.config.load import check_override_keys

    with pytest.raises(ConfigError, match=r"'trainer\.total_step'.*Did you mean "
                                          r"trainer\.total_steps\?"):
        check_override_keys(["experiment=tiny_cpu", "trainer.total_step=5"])
    with pytest.raises(ConfigError, match=r"Did you mean algo\.max_staleness\?"):
        check_override_keys(["trainer.max_staleness=1"])  # the right key, in another section
    with pytest.raises(ConfigError, match=r"Did you mean trainer\.lr\?"):
        check_override_keys(["trainr.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz' \(in 'zzz=1'\)\. Every"):
        check_override_keys(["zzz=1"])
    # what is not a schema key passes: group choices, Hydra's own, +/~, free-form dicts, flags
    check_override_keys(["experiment=tiny_cpu", "algo=gspo", "+x=1", "~seed", "hydra.run.dir=d",
                         "env.kwargs.x=1", "--config-dir", "d", "-m", "seed=3",
                         "trainer.lr=1e-3", "weight_sync.pause_mode=abort", "algo=grpo,gspo"])


def test_a_wrong_type_names_the_type_and_an_example(tmp_path):
    """relax-train itself (a process): exit 1 before Hydra composes, no run dir left."""
    import subprocess
    import sys

    from tests.conftest import REPO, run_env

    proc = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
                           f"run_dir={tmp_path / 'run'}", "trainer.lr=abc"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=run_env())
    assert proc.returncode == 1
    assert ("trainer.lr=abc: trainer.lr takes a number (float), e.g. trainer.lr=1e-06"
            in proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,expected", [
    ("trainer.total_steps=1.5", "takes an integer (int), e.g. trainer.total_steps=100"),
    ("algo.max_staleness=two", "takes an integer (int), e.g. algo.max_staleness=0"),
    ("metrics.progress=maybe", "takes true or false (bool), e.g. metrics.progress=true"),
    ("trainer.lr_decay_steps=x", "takes an integer (int) or null, e.g. trainer.lr_decay_steps=1"),
])
def test_wrong_types_are_refused_before_hydra(override, expected):
    from relax_slurm.config.load import check_override_keys

    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_override_keys([override])


def test_sweep_values_are_checked_one_by_one():
    """`relax-train -m key=a,b`: each value of a sweep has the key's type; Hydra's sweep
    functions are Hydra's to expand."""
    from relax_slurm.config.load import check_override_keys, sweep_items

    assert sweep_items("1,2") == ["1", "2"] and sweep_items("[a,b],[c]") == ["[a,b]", "[c]"]
    assert sweep_items("'x,y'") == ["'x,y'"] and sweep_items("range(1,3)") == []
    check_override_keys(["rollout.num_engines=1,2", "trainer.lr=1e-3,3e-3",
                         "trainer.total_steps=range(1,5)"])
    with pytest.raises(ConfigError, match=re.escape("rollout.num_engines=x: rollout.num_engines "
                                                    "takes an integer")):
        check_override_keys(["rollout.num_engines=1,x"])


def test_every_default_passes_the_type_check():
    """No false alarm: each int/float/bool key set to its own default (and interpolations,
    null for Optional keys) passes."""
    import dataclasses

    from relax_slurm.config.load import check_override_keys, section_class
    from relax_slurm.config.schema import TrainConfig
    from relax_slurm.config.variants import variants_of

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            sub = section_class(cls, f.name)
            if sub is not None:  # each variant's keys (cluster: local and slurm)
                for variant in variants_of(sub):
                    yield from leaves(variant, f"{prefix}{f.name}.")
            elif isinstance(f.default, (bool, int, float)):
                yield f"{prefix}{f.name}", f.default
    checked = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
               for k, v in leaves(TrainConfig)]
    assert len(checked) > 100
    check_override_keys(checked)
    check_override_keys(["trainer.lr_decay_steps=null", "trainer.lr=${trainer.min_lr_ratio}",
                         "trainer.total_steps=1_000", "trainer.lr=3"])


def test_help_lists_choices_without_the_internal_schemas():
    """`relax-train --help` (a process): every preset and group option, no base_* schema."""
    import subprocess
    import sys

    from tests.conftest import REPO, run_env

    proc = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "--help",
                           "experiment=tiny_cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=run_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "base_" not in proc.stdout
    groups = proc.stdout.split("== Config ==")[0]
    lines = dict(line.split(": ", 1) for line in groups.splitlines()
                 if line.split(":")[0] in ("algo", "experiment", "trainer"))
    assert "grpo" in lines["algo"] and "tiny_cpu" in lines["experiment"], proc.stdout[:2000]
    # algo=ppo's trainer settings are neither an algorithm nor a group to choose
    assert "trainer/" not in lines["algo"] and "algo_trainer" not in groups
    assert lines["trainer"] == "megatron, torch"
    assert "total_steps: 150" in proc.stdout  # the config composed with the overrides given


def test_bad_yaml_file_is_named(tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("run_dir: x\nalgo: {max_staleness: [1,\n")
    with pytest.raises(ConfigError, match="config.yaml"):
        load_config(bad)


@pytest.mark.parametrize("staleness,want", [(0, "recompute"), (2, "rollout")])
def test_old_logprobs_auto_follows_staleness(staleness, want):
    from relax_slurm.config.algo import AlgoConfig

    assert AlgoConfig(max_staleness=staleness).old_logprobs == want
    assert AlgoConfig(max_staleness=staleness, old_logprobs="recompute").old_logprobs == "recompute"
    with pytest.raises(ConfigError, match="algo.old_logprobs"):
        AlgoConfig(old_logprobs="behaviour")


def test_env_group_picks_multi_turn_and_checks_its_keys():
    cfg = to_train_config(_compose(["experiment=tiny_agent_cpu", "env.max_turns=5"]))
    assert (cfg.env.name, cfg.env.max_turns, cfg.env.kwargs["max_tries"]) == \
        ("arith_feedback", 5, 3)
    assert to_train_config(_compose([])).env.name is None  # env=none: single-turn
    for bad, key in (("env.reward_source=judge", "env.reward_source"),
                     ("env.max_turns=0", "env.max_turns")):
        with pytest.raises(ConfigError, match=key):
            to_train_config(_compose(["env=arith_feedback", bad]))


def test_megatron_parallel_sizes_are_validated():
    cfg = to_train_config(_compose(["experiment=tiny_cpu", "trainer=megatron",
                                    "trainer.tensor_parallel_size=2"]))
    assert (cfg.trainer.backend, cfg.trainer.tensor_parallel_size) == ("megatron", 2)
    with pytest.raises(ConfigError, match="need trainer=megatron"):
        to_train_config(_compose(["trainer.tensor_parallel_size=2"]))
    with pytest.raises(ConfigError, match="do not split into trainer.tensor_parallel_size=2 x "
                                          "pipeline_parallel_size=2"):
        to_train_config(_compose(["trainer=megatron", "trainer.nproc_per_node=2",
                                  "trainer.tensor_parallel_size=2",
                                  "trainer.pipeline_parallel_size=2"]))
    with pytest.raises(ConfigError, match="expert_parallel_size=4 must divide"):
        to_train_config(_compose(["trainer=megatron", "trainer.nproc_per_node=2",
                                  "trainer.expert_parallel_size=4"]))
    # CP is validated for shape here, and for hardware when the trainer starts (needs CUDA + TE)
    assert to_train_config(_compose(["trainer=megatron", "trainer.context_parallel_size=2"])
                           ).trainer.context_parallel_size == 2
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        to_train_config(_compose(["trainer=megatron", "trainer.context_parallel_size=2",
                                  "trainer.tensor_parallel_size=2"]))
    assert to_train_config(_compose(["trainer=megatron", "trainer.async_save=true"])
                           ).trainer.async_save
    cfg = to_train_config(_compose(["trainer=megatron", "trainer.use_distributed_optimizer=true"]))
    assert cfg.trainer.use_distributed_optimizer
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp2"):
        to_train_config(_compose(["trainer.use_distributed_optimizer=true"]))


def test_tiny_video_preset_reads_videos_only_and_tells_the_engine():
    from relax_slurm.launch.roles import _media_flags

    cfg = to_train_config(_compose(["experiment=tiny_video_cpu"]))
    assert cfg.data.multimodal_keys == {"video": "videos"}  # no image key merged in
    flags = _media_flags(cfg)
    assert flags[flags.index("--video-max-frames") + 1] == "4"
    assert flags[flags.index("--video-fps") + 1] == "4.0"
    assert "--video-max-pixels" not in flags  # null: the engine uses the image limit
    cfg = to_train_config(_compose(["experiment=tiny_video_cpu", "data.video_max_pixels=784"]))
    flags = _media_flags(cfg)
    assert flags[flags.index("--video-max-pixels") + 1] == "784"


def test_num_steps_per_rollout_is_validated_and_blocks_streaming():
    base = ["experiment=tiny_cpu", "algo.max_staleness=1"]
    cfg = to_train_config(_compose([*base, "trainer.num_steps_per_rollout=2"]))
    assert cfg.trainer.num_steps_per_rollout == 2 and not cfg.streams
    assert any("num_steps_per_rollout=2" in b for b in cfg.streaming_blockers())
    with pytest.raises(ConfigError, match=r"num_steps_per_rollout=2.*trainer\.streaming"):
        to_train_config(_compose([*base, "trainer.num_steps_per_rollout=2",
                                  "trainer.streaming=true"]))
    with pytest.raises(ConfigError, match=r"num_steps_per_rollout=3 must divide"):
        to_train_config(_compose([*base, "trainer.num_steps_per_rollout=3"]))
    megatron = to_train_config(_compose([*base, "trainer=megatron",
                                         "trainer.num_steps_per_rollout=2"]))
    assert megatron.trainer.num_steps_per_rollout == 2  # both backends take mini-batches
    with pytest.raises(ConfigError, match=r"num_steps_per_rollout=0: must be >= 1"):
        to_train_config(_compose([*base, "trainer.num_steps_per_rollout=0"]))


def test_sft_refuses_the_rollout_knobs_it_has_no_data_for():
    """algo=sft on an RL experiment keeps that experiment's algo overrides (tiny_cpu's
    tis_clip): refused, naming the overrides that fix it."""
    with pytest.raises(ConfigError, match=r"algo=sft .*algo\.tis_clip=null"):
        to_train_config(_compose(["experiment=tiny_cpu", "algo=sft"]))
    cfg = to_train_config(_compose(["experiment=tiny_cpu", "algo=sft", "algo.tis_clip=null"]))
    assert cfg.supervised and not to_train_config(_compose(["experiment=tiny_cpu"])).supervised
    with pytest.raises(ConfigError, match=r"rollout\.temperature=1\.0"):
        to_train_config(_compose(["experiment=tiny_sft_cpu", "rollout.temperature=0.7"]))
    with pytest.raises(ConfigError, match=r"unset data\.multimodal_keys"):
        to_train_config(_compose(["experiment=tiny_sft_cpu", "+data.multimodal_keys={image: i}"]))
    with pytest.raises(ConfigError, match=r"no rollout reward .*trainer\.stop_at\.reward=null"):
        to_train_config(_compose(["experiment=tiny_sft_cpu", "trainer.stop_at.reward=0.5"]))
    assert to_train_config(_compose(["experiment=tiny_sft_cpu", "trainer=megatron"])).supervised


def test_ppo_presets_and_the_command_line_wins():
    """algo=ppo brings four mini-batch steps per batch (conf/algo_trainer/ppo.yaml, composed
    after the trainer group), the tiny task its PPO lr (conf/tuning/tiny_cpu_ppo.yaml); the
    command line still wins, and other algorithms keep the preset's own lr."""
    ppo = to_train_config(_compose(["experiment=tiny_cpu", "algo=ppo"]))
    assert (ppo.trainer.num_steps_per_rollout, ppo.trainer.lr) == (4, 1e-3)
    mine = to_train_config(_compose(["experiment=tiny_cpu", "algo=ppo", "trainer.lr=3e-3",
                                     "trainer.num_steps_per_rollout=1"]))
    assert (mine.trainer.num_steps_per_rollout, mine.trainer.lr) == (1, 3e-3)
    grpo = to_train_config(_compose(["experiment=tiny_cpu", "algo=grpo"]))
    assert (grpo.trainer.num_steps_per_rollout, grpo.trainer.lr) == (1, 2e-3)
    bare = to_train_config(_compose(["algo=ppo"]))  # no experiment: no tuning file, still N=4
    assert bare.trainer.num_steps_per_rollout == 4


def test_ppo_under_megatron_takes_tensor_parallelism_and_refuses_pipelines():
    """The megatron critic runs under TP/DP/EP; PP and CP are refused naming the key to set
    (trainer/megatron/critic.py: its values would exist on the last stage / in CP chunks)."""
    ppo = ["experiment=tiny_cpu", "algo=ppo", "trainer=megatron", "trainer.nproc_per_node=2"]
    cfg = to_train_config(_compose([*ppo, "trainer.tensor_parallel_size=2"]))
    assert (cfg.algo.uses_critic, cfg.trainer.tensor_parallel_size) == (True, 2)
    for key in ("pipeline_parallel_size", "context_parallel_size"):
        with pytest.raises(ConfigError, match=f"trainer.{key}=2: the megatron critic runs "
                                              "under tensor, data and expert parallelism only; "
                                              f"set trainer.{key}=1"):
            to_train_config(_compose([*ppo, f"trainer.{key}=2"]))


def test_megatron_routing_replay_under_tensor_parallelism_but_not_context_parallelism():
    """An MoE model at TP > 1 trains with sequence parallelism, whose per-rank slices the
    replay maps (trainer/megatron/routing.py); context parallelism's replay is refused, naming
    the fix."""
    replay = ["experiment=tiny_moe_cpu", "trainer=megatron", "algo.routing_replay=true"]
    for parallel in ("trainer.tensor_parallel_size=2", "trainer.expert_parallel_size=2"):
        assert to_train_config(_compose([*replay, "trainer.nproc_per_node=2",
                                         parallel])).algo.routing_replay
    with pytest.raises(ConfigError, match="trainer.context_parallel_size > 1 is not supported "
                                          "yet.*Fix: trainer.context_parallel_size=1"):
        to_train_config(_compose([*replay, "trainer.nproc_per_node=2",
                                  "trainer.context_parallel_size=2"]))
    # the comparison alone (on by default) is not refused under CP
    assert to_train_config(_compose(["experiment=tiny_moe_cpu", "trainer=megatron",
                                     "trainer.nproc_per_node=2",
                                     "trainer.context_parallel_size=2"])
                           ).rollout.return_routed_experts
