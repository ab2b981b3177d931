"""PowerLimitCallback with the real ``lightning.Trainer`` on simulated GPUs (virtual clock).

The model trains for real on the CPU; a helper callback placed before the joules one
advances the simulated GPUs' clock by one training step's work at each training batch end,
and by evaluation work at each validation batch (sanity check included), so the optimizer
measures simulated GPU time and energy exactly as it would on real GPUs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
try:
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip("pytorch_lightning")

from _common import CF, EVAL_WORK_S, PRESET_W, WORK_S, check_profiled_chose_and_restored, truth  # noqa: E402

from joules.devices.sim import Constant, Simulator  # noqa: E402
from joules.integrations.lightning import PowerLimitCallback  # noqa: E402
from joules.monitoring.monitor import EnergyMonitor  # noqa: E402
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)




class MLP(pl.LightningModule):
    """A 2-layer regression MLP; ``training_step`` fails after ``fail_after`` batches."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.fail_after = fail_after
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        if self.fail_after is not None and self.batches > self.fail_after:
            raise RuntimeError("boom: simulated crash in training_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def loader(n: int, seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1) + 0.1 * torch.randn(n, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class SimWork(pl.Callback):
    """Runs each batch's work on the simulated GPUs and records the limits it ran at.

    Must come before the joules callback, so that the work lies between its step begin and end.
    """

    def __init__(self, sim: Simulator, opt: PowerLimitOptimizer) -> None:
        self.sim, self.opt = sim, opt
        self.seen: list[tuple[State, float]] = []  # (optimizer state, GPU limit) at each training batch
        self.val_batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((self.opt.state, self.sim.gpus[0].power_limit_w()))
        self.sim.run(WORK_S, CF)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_batches += 1
        self.sim.run(EVAL_WORK_S, CF)


def setup(max_epochs: int = 20, **trainer_kw):
    sim = Simulator("A100")
    sim.set_workload(Constant(1.0), cpus=False)
    sim.gpus[0].set_power_limit_w(PRESET_W)
    opt = PowerLimitOptimizer(EnergyMonitor(devices=sim.devices()), selector="energy", warmup_steps=2,
                              profile_steps=5, handle_signals=False)
    work = SimWork(sim, opt)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[work, PowerLimitCallback(opt)],
        **trainer_kw,
    )
    return sim, opt, work, trainer


def test_trainer_profiles_picks_a_limit_runs_at_it_and_restores():
    sim, opt, work, trainer = setup(val_check_interval=7)  # validation every 7 batches, and at epoch end
    trainer.fit(MLP(), loader(176), loader(32, seed=1))

    check_profiled_chose_and_restored(sim, opt, work.seen)
    assert work.val_batches > 2
    assert len(work.seen) == 220
    assert opt.guard.changed == []


@pytest.mark.parametrize("weights_only", [False, True])
def test_checkpoint_saving_pauses_the_measurement(tmp_path, weights_only: bool):
    """Also weights-only checkpoints, for which Lightning calls no callback's on_save_checkpoint."""
    sim, opt, work, trainer = setup(max_epochs=16, limit_val_batches=0)
    saved: list[State] = []
    model = MLP()

    class SaveEvery4(pl.Callback):  # saving a checkpoint takes 2 s of (simulated) time
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 4 == 0:
                saved.append(opt.state)
                trainer.save_checkpoint(tmp_path / "last.ckpt", weights_only=weights_only)
                sim.advance(2.0)

    trainer.callbacks.append(SaveEvery4())
    trainer.fit(model, loader(176))
    assert State.PROFILING in saved or State.WARMUP in saved
    assert opt.chosen_limit_w is not None and len(opt.points) >= 3  # checkpoints did not stop it
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth(limit).time_s, rel=1e-2)
    assert sim.gpus[0].power_limit_w() == PRESET_W
    assert "save_checkpoint" not in vars(trainer)  # the trainer is left as it was


def test_exception_in_training_step_restores_the_limit():
    sim, opt, work, trainer = setup()
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(MLP(fail_after=15), loader(176), loader(32, seed=1))  # no `with optimizer:` needed
    assert len(work.seen) == 15
    assert any(limit != PRESET_W for _, limit in work.seen)  # it had been changed
    assert sim.gpus[0].power_limit_w() == PRESET_W
    assert opt.guard.changed == []


def test_fit_again_after_an_exception_measures_no_idle_time_and_chooses_as_a_clean_fit():
    sim, clean, _, trainer = setup()
    trainer.fit(MLP(), loader(176), loader(32, seed=1))

    sim, opt, work, trainer = setup()
    model = MLP(fail_after=13)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, loader(176), loader(32, seed=1))
    assert sim.gpus[0].power_limit_w() == PRESET_W  # on_exception restored
    sim.advance(300.0)
    model.fail_after = None
    again = pl.Trainer(accelerator="cpu", devices=1, max_epochs=20, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[work, PowerLimitCallback(opt)])
    again.fit(model, loader(176), loader(32, seed=1))
    assert opt.state is State.DONE and opt.chosen_limit_w == clean.chosen_limit_w
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth(limit).time_s, rel=1e-2)
    done = [limit for state, limit in work.seen[13:] if state is State.DONE]
    assert len(done) >= 20 and set(done) == {opt.chosen_limit_w}
    assert sim.gpus[0].power_limit_w() == PRESET_W


@pytest.mark.parametrize("batches", [24, 26])
def test_a_step_is_an_accumulation_cycle_however_validation_splits_them(batches: int):
    # accumulate_grad_batches=4: three batches only accumulate (0.1 s of work), the fourth also
    # steps the optimizer (0.5 s). Validation every 6 batches lands mid-cycle; a point counting
    # batches would hold uneven shares of light and heavy ones (off by up to 25 %). With 26
    # batches an epoch ends in a cycle of 2, which Lightning steps early: it is not measured.
    k, light, heavy = 4, 0.1, 0.5
    sim, opt, work, trainer = setup(max_epochs=40, accumulate_grad_batches=k, val_check_interval=6)

    class CycleWork(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sim.run(light if (batch_idx + 1) % k else heavy, CF)

    trainer.callbacks = [CycleWork(), *[c for c in trainer.callbacks if not isinstance(c, SimWork)]]
    trainer.fit(MLP(), loader(16 * batches), loader(32, seed=1))

    def cycle(limit: float) -> tuple[float, float]:
        s = Simulator("A100")
        s.set_workload(Constant(1.0), cpus=False)
        s.gpus[0].set_power_limit_w(limit)
        e0 = s.gpus[0].true_energy_j()
        t = sum(s.run(w, CF) for w in (light, light, light, heavy))
        return t, s.gpus[0].true_energy_j() - e0

    assert len(opt.points) >= 3
    for limit, p in opt.points.items():
        t, e = cycle(limit)
        assert p.time_s == pytest.approx(t, rel=1e-2) and p.energy_j == pytest.approx(e, rel=2e-2)
    assert opt.chosen_limit_w == min(opt.points, key=lambda w: cycle(w)[1])
    assert sim.gpus[0].power_limit_w() == PRESET_W


def test_an_epoch_of_fewer_batches_than_a_cycle_is_one_step_and_is_measured():
    # accumulate_grad_batches=16 over epochs of 11 batches: Lightning steps once per epoch,
    # with all 11. Every cycle is that short: each is a step, and profiling goes on.
    sim, opt, work, trainer = setup(max_epochs=40, accumulate_grad_batches=16)
    opt.profile_steps = 2
    trainer.fit(MLP(), loader(176))
    assert opt.state is State.DONE and len(opt.points) >= 3
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(11 * truth(limit).time_s, rel=1e-2)
    assert sim.gpus[0].power_limit_w() == PRESET_W


class ManualMLP(MLP):
    """Manual optimization with the plain torch optimizer: ``trainer.global_step`` never moves."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=False)
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_under_manual_optimization_every_batch_is_a_step():
    sim, opt, work, trainer = setup(max_epochs=30)
    trainer.fit(ManualMLP(), loader(176))
    assert trainer.global_step == 0
    check_profiled_chose_and_restored(sim, opt, work.seen)


def test_a_spawning_strategy_is_told_to_use_ddp() -> None:
    """``strategy="ddp_spawn"`` pickles the callbacks: it failed with "cannot pickle
    '_thread.RLock' object", naming neither joules nor a fix."""
    import pickle

    sim = Simulator("A100")
    opt = PowerLimitOptimizer(EnergyMonitor(devices=sim.devices()), dry_run=True, handle_signals=False)
    with pytest.raises(TypeError, match=r"PowerLimitCallback cannot be sent to another.*strategy='ddp'"):
        pickle.dumps(PowerLimitCallback(opt))
    import copy

    callback = PowerLimitCallback(opt)
    assert copy.copy(callback).optimizer is opt  # a shallow copy drives the same optimizer
