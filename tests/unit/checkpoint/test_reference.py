"""algo.ref_update_interval: the frozen reference becomes the policy every N rollout batches, is
checkpointed with it, and a resume continues exactly as the straight run (one gloo rank, the
torch backend on the tiny model)."""

from __future__ import annotations

import pytest
import torch

from relax_slurm.checkpoint import find_latest, load_checkpoint, save_checkpoint
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.backend import TorchBackend
from relax_slurm.trainer.batch import collate, prepare_items
from relax_slurm.trainer.model import reference_due, refresh_reference, single_process_group
from tests.unit.trainer.test_step import groups


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():
        yield


def config(tiny_dir, interval=2) -> TrainConfig:
    return TrainConfig(
        run_dir="unused", model=ModelConfig(path=str(tiny_dir)),
        algo=AlgoConfig(kl_loss_coef=0.1, kl_loss_type="k3", ref_update_interval=interval),
        rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=4),
        trainer=TrainerConfig(lr=1e-2, nproc_per_node=1, micro_batch_size=4))


def one_step(backend: TorchBackend, seed: int) -> dict:
    items = prepare_items(groups(), backend.cfg.algo)
    for it in items:  # vary the advantages per step so every step moves the weights
        it.advantage *= 1 + seed
    return backend.train_step([(collate(items, backend.pad_id, torch.device("cpu")), True)])


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_reference_due_every_interval_batches():
    assert [s for s in range(1, 8) if reference_due(s, 3)] == [3, 6]
    assert not any(reference_due(s, None) for s in range(1, 8))


def test_refresh_copies_the_policy(tiny_dir):
    backend = TorchBackend(config(tiny_dir), torch.device("cpu"))
    one_step(backend, 0)  # step 1: not due, the reference is still model.path
    start = TorchBackend(config(tiny_dir, interval=None), torch.device("cpu"))
    for k, v in backend.ref_model.state_dict().items():
        assert torch.equal(v, start.ref_model.state_dict()[k]), k
    out = one_step(backend, 1)  # step 2: the KL is measured before the refresh
    assert out["train/kl_loss"] > 0
    for k, v in backend.model.state_dict().items():
        assert torch.equal(v, backend.ref_model.state_dict()[k]), k
    # same weights as the reference now: the next step's KL (before its update) is 0
    assert one_step(backend, 2)["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)


def test_resume_restores_the_refreshed_reference_exactly(tiny_dir, tmp_path):
    straight = TorchBackend(config(tiny_dir), torch.device("cpu"))
    for seed in range(3):  # refreshed after step 2, then step 3 moves the policy away from it
        one_step(straight, seed)
    straight.save(tmp_path, 3, {}, keep_last=1, async_save=False, hf_assets_src=None)
    ref_at_3 = weights(straight.ref_model)
    assert any(not torch.equal(v, straight.model.state_dict()[k]) for k, v in ref_at_3.items())

    resumed = TorchBackend(config(tiny_dir), torch.device("cpu"))
    extra = resumed.load(find_latest(tmp_path))
    assert extra["step"] == 3 and resumed.steps_done == 3
    for k, v in resumed.ref_model.state_dict().items():
        assert torch.equal(v, ref_at_3[k]), k
    # step 4 (a refresh is due after it): the same computation on the same weights, bit for bit
    a, b = one_step(straight, 3), one_step(resumed, 3)
    assert a["train/kl_loss"] == b["train/kl_loss"] > 0
    for (k, x), (_, y) in zip(straight.model.state_dict().items(),
                              resumed.model.state_dict().items()):
        assert torch.equal(x, y), k
    for (k, x), (_, y) in zip(straight.ref_model.state_dict().items(),
                              resumed.ref_model.state_dict().items()):
        assert torch.equal(x, y), k


def test_a_checkpoint_without_reference_leaves_it_as_loaded(tiny_dir, tmp_path):
    model = TorchBackend(config(tiny_dir, interval=None), torch.device("cpu"))
    save_checkpoint(tmp_path, 1, model.model, model.optimizer, model.scheduler, {}, keep_last=1)
    ref = TorchBackend(config(tiny_dir), torch.device("cpu")).ref_model
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    before = weights(ref)
    extra = load_checkpoint(find_latest(tmp_path), model.model, model.optimizer,
                            model.scheduler, reference=ref)
    assert "reference_saved" not in extra
    for k, v in ref.state_dict().items():
        assert torch.equal(v, before[k]), k
    refresh_reference(ref, model.model)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.model.state_dict()[k]), k


def test_ref_update_interval_needs_a_reference(tiny_dir):
    with pytest.raises(ConfigError, match=r"algo.ref_update_interval=2 .*kl_loss_coef > 0"):
        AlgoConfig(ref_update_interval=2)
    with pytest.raises(ConfigError, match=r"ref_update_interval=0: must be >= 1"):
        AlgoConfig(kl_loss_coef=0.1, ref_update_interval=0)
    # both backends refresh and checkpoint it
    TrainConfig(run_dir="x", model=ModelConfig(path=str(tiny_dir)),
                algo=AlgoConfig(kl_loss_coef=0.1, ref_update_interval=2),
                trainer=TrainerConfig(backend="megatron"))
