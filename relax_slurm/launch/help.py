"""`relax-train --help`: the groups a user can pick and the composed config, as Hydra's help
shows them, minus the internal `base_<group>` schemas (ConfigStore entries every group's YAML
extends, never a choice of their own)."""

from __future__ import annotations

from pathlib import Path

INTERNAL_PREFIX = "base_"
# groups an algorithm preset pulls in (conf/algo/NAME.yaml's defaults), not a user's choice:
# algo_trainer/NAME.yaml is what algo=NAME sets of the trainer
PULLED_IN_GROUPS = ("algo_trainer",)
HELP_FLAGS = ("--help", "-h")

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
"""A source checkout's docs/; an installed package has none (the docs are not package data)."""


def doc_ref(*names: str) -> str:
    """Where the docs `names` are: their paths in a source checkout, else their names in the
    project's docs/ (an installed package has no docs/ to point to)."""
    if all((DOCS_DIR / n).is_file() for n in names):
        return ", ".join(str(DOCS_DIR / n) for n in names)
    return f"{', '.join(names)} in the relax-slurm repository's docs/"


HEADER = """relax-train: RL post-training on Slurm or one machine ({docs})

usage: relax-train experiment=NAME [group=option ...] [key=value ...]
       relax-train experiment=NAME --cfg job     the composed config
       relax-train --hydra-help                   Hydra's own flags

== Configuration groups ==
Compose your configuration from those groups (group=option)
"""


def group_options(conf_dir: Path, overrides: list[str]) -> tuple[dict[str, list[str]], str]:
    """({group: user-facing options}, the composed config as YAML) for these overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = {g: sorted(o for o in loader.get_group_options(g)
                            if not o.startswith(INTERNAL_PREFIX))
                  for g in sorted(loader.list_groups(""))
                  if g != "hydra" and g not in PULLED_IN_GROUPS}
        cfg = compose(config_name="train", overrides=overrides)
    return groups, OmegaConf.to_yaml(cfg)


def help_text(conf_dir: Path, overrides: list[str]) -> str:
    groups, config = group_options(conf_dir, overrides)
    lines = [f"{g}: {', '.join(opts)}" for g, opts in groups.items() if opts]
    return (HEADER.format(docs=doc_ref("quickstart.md")) + "\n".join(lines)
            + "\n\n== Config ==\nOverride anything in the config (foo.bar=value); "
            f"{doc_ref('configuration.md')}\n\n" + config)
