"""PowerLimitCallback with the real ``transformers.Trainer`` on simulated GPUs (virtual clock).

The model trains for real on the CPU; a helper callback placed before the joules one
advances the simulated GPUs' clock by one training step's work at each ``on_step_end``, and
by evaluation work at each evaluation batch, so the optimizer measures simulated GPU time
and energy exactly as it would on real GPUs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _common import CF, EVAL_WORK_S, PRESET_W, WORK_S, check_profiled_chose_and_restored, truth  # noqa: E402

from joules.devices.sim import Constant, Simulator  # noqa: E402
from joules.integrations.huggingface import PowerLimitCallback  # noqa: E402
from joules.monitoring.monitor import EnergyMonitor  # noqa: E402
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")




class MLP(torch.nn.Module):
    """A 2-layer regression MLP in the Trainer's calling convention; fails after ``fail_after`` steps."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.fail_after = fail_after
        self.train_calls = 0

    def forward(self, x, labels=None):
        if self.training:
            self.train_calls += 1
            if self.fail_after is not None and self.train_calls > self.fail_after:
                raise RuntimeError("boom: simulated crash in forward")
        out = self.net(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


class RandomData(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class SimWork(transformers.TrainerCallback):
    """Runs each step's (and each evaluation batch's) work on the simulated GPUs; records limits.

    Must come before the joules callback, so that the work lies between its step begin and end.
    """

    def __init__(self, sim: Simulator, opt: PowerLimitOptimizer) -> None:
        self.sim, self.opt = sim, opt
        self.seen: list[tuple[State, float]] = []  # (optimizer state, GPU limit) at each step
        self.eval_batches = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((self.opt.state, self.sim.gpus[0].power_limit_w()))
        self.sim.run(WORK_S, CF)

    def on_prediction_step(self, args, state, control, **kwargs):
        self.eval_batches += 1
        self.sim.run(EVAL_WORK_S, CF)


def setup(tmp_path: Path, model: MLP, epochs: int = 20, state_file: str | None = None,
          args_kw: dict | None = None, **opt_kw):
    sim = Simulator("A100", state_file=state_file)
    sim.set_workload(Constant(1.0), cpus=False)
    sim.gpus[0].set_power_limit_w(PRESET_W)
    opt_kw.setdefault("selector", "energy")
    opt_kw.setdefault("warmup_steps", 2)
    opt_kw.setdefault("profile_steps", 5)
    opt_kw.setdefault("handle_signals", False)
    opt = PowerLimitOptimizer(EnergyMonitor(devices=sim.devices()), **opt_kw)
    work = SimWork(sim, opt)
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": [], "save_strategy": "no",
        "logging_strategy": "no", "disable_tqdm": True, "num_train_epochs": epochs,
        "per_device_train_batch_size": 16, "per_device_eval_batch_size": 16, "eval_strategy": "steps",
        "eval_steps": 7, "learning_rate": 1e-2, "remove_unused_columns": False, "dataloader_num_workers": 0,
        "seed": 0, **(args_kw or {}),
    })
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomData(176),
                                   eval_dataset=RandomData(32, seed=1),
                                   callbacks=[work, PowerLimitCallback(opt)])  # work first
    return sim, opt, work, trainer


def test_trainer_profiles_picks_a_limit_runs_at_it_and_restores(tmp_path):
    sim, opt, work, trainer = setup(tmp_path, MLP())
    trainer.train()

    check_profiled_chose_and_restored(sim, opt, work.seen)
    assert work.eval_batches > 0
    assert len(work.seen) == trainer.state.global_step == 220
    assert opt.guard.changed == []


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    sim, opt, work, trainer = setup(tmp_path, MLP(), epochs=2)
    trainer.args.gradient_accumulation_steps = 2
    trainer.train()
    # One joules step per optimizer step (2 micro-batches): 11 batches -> 6 steps per epoch.
    assert len(work.seen) == trainer.state.global_step == 12
    assert sim.gpus[0].power_limit_w() == PRESET_W


@pytest.mark.parametrize("samples", [144, 128])
def test_an_epochs_short_last_accumulation_cycle_is_not_measured_as_a_step(tmp_path, samples: int):
    # gradient_accumulation_steps=4 and 9 batches an epoch (144 samples): cycles of 4, 4 and
    # 1. Every micro-batch does the same work; a point must be the work of 4 of them, not the
    # mean over full and short cycles. (128 samples: 8 batches, no short cycle.)
    k = 4
    sim, opt, _, trainer = setup(tmp_path, MLP(), epochs=40, args_kw={
        "gradient_accumulation_steps": k, "eval_steps": 4}, warmup_steps=1, profile_steps=3)

    class MicroBatchWork(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            sim.run(WORK_S, CF)  # a micro-batch that only accumulates

        def on_step_end(self, args, state, control, **kwargs):
            sim.run(WORK_S, CF)  # the one that also steps

    trainer.callback_handler.callbacks = [
        MicroBatchWork(), *[c for c in trainer.callback_handler.callbacks if not isinstance(c, SimWork)]]
    trainer.train_dataset = RandomData(samples)
    trainer.train()
    assert len(opt.points) >= 3
    for limit, point in opt.points.items():
        t = truth(limit)
        assert point.time_s == pytest.approx(k * t.time_s, rel=1e-3)
        assert point.energy_j == pytest.approx(k * t.energy_j, rel=1e-3)
    assert opt.chosen_limit_w == min(opt.points, key=lambda w: truth(w).energy_j)
    assert sim.gpus[0].power_limit_w() == PRESET_W


def test_an_epoch_of_fewer_batches_than_a_cycle_is_one_step_and_is_measured(tmp_path):
    # gradient_accumulation_steps=16 over epochs of 11 batches: the Trainer steps once per
    # epoch, with all 11. Every cycle is that short: each is a step, and profiling goes on.
    sim, opt, work, trainer = setup(tmp_path, MLP(), epochs=40, args_kw={
        "gradient_accumulation_steps": 16, "eval_strategy": "no"}, profile_steps=2)
    trainer.train()
    assert opt.state is State.DONE and len(opt.points) >= 3
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth(limit).time_s, rel=1e-3)
    assert sim.gpus[0].power_limit_w() == PRESET_W


@pytest.mark.parametrize("replayed", [False, True])
def test_a_run_resumed_mid_epoch_foresees_the_short_last_cycle(tmp_path, replayed: bool):
    # 50 batches an epoch, k=3: 16 cycles and one of 2. Resumed from a checkpoint at step 20
    # (mid epoch 2), the callback counts that epoch's steps from the checkpoint's, so it
    # pauses before the short cycle; a pause within a step (the cycle seen short only at its
    # end) would make the optimizer drop what it had measured and split its windows. With
    # ``ignore_data_skip`` the Trainer replays that epoch from its first batch: its cycles (and
    # every later epoch's) count from the start (they were counted from the checkpoint's step).
    args = {"gradient_accumulation_steps": 3, "eval_strategy": "no", "save_strategy": "steps",
            "save_steps": 20, "num_train_epochs": 3 if replayed else 2, "ignore_data_skip": replayed}
    train = RandomData(800)
    sim, opt, _, trainer = setup(tmp_path, MLP(), args_kw={**args, "max_steps": 20}, dry_run=True)
    trainer.train_dataset = train
    trainer.train()
    sim, opt, _, trainer = setup(tmp_path, MLP(), args_kw=args, warmup_steps=1, profile_steps=3,
                                 dry_run=True)
    trainer.train_dataset = train
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-20"))
    assert trainer.state.global_step == (51 if replayed else 34)
    assert not opt._split_steps and opt.points


def test_exception_in_training_restores_the_limit_with_the_optimizer_as_context(tmp_path):
    sim, opt, work, trainer = setup(tmp_path, MLP(fail_after=15))
    with pytest.raises(RuntimeError, match="boom"):
        with opt:  # what the docs recommend: the Trainer calls no callback when train() raises
            trainer.train()
    assert len(work.seen) == 15
    assert any(limit != PRESET_W for _, limit in work.seen)  # it had been changed
    assert sim.gpus[0].power_limit_w() == PRESET_W
    assert opt.guard.changed == []


def test_train_again_after_a_caught_exception_profiles_the_interrupted_limit_again(tmp_path):
    """A notebook or retry loop: train() raises mid-profiling, is caught, and runs again later."""
    sim, clean, _, trainer = setup(tmp_path / "clean", MLP())
    trainer.train()

    model = MLP(fail_after=13)
    sim, opt, work, trainer = setup(tmp_path, model)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()  # no `with optimizer:`: the Trainer calls no callback when it raises
        assert opt.state is State.PROFILING and sim.gpus[0].power_limit_w() == 375.0
        sim.advance(300.0)  # the traceback is read, the bug fixed
        model.fail_after = None
        trainer.train()
    finally:
        opt.restore()

    assert opt.state is State.DONE
    for limit, p in opt.points.items():  # the idle 300 s are in no point
        assert p.time_s == pytest.approx(truth(limit).time_s, rel=1e-2)
    assert opt.points[375.0].time_s < 0.21
    assert opt.chosen_limit_w == clean.chosen_limit_w
    assert list(opt.points) == list(clean.points)
    assert sim.gpus[0].power_limit_w() == PRESET_W and opt.guard.changed == []


class CtrlC(transformers.TrainerCallback):
    """Presses Ctrl-C a few steps after the optimizer has chosen its limit, once."""

    def __init__(self, opt: PowerLimitOptimizer) -> None:
        self.opt, self.done_steps, self.sent = opt, 0, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.opt.state is State.DONE and not self.sent:
            self.done_steps += 1
            if self.done_steps == 5:
                self.sent = True
                os.kill(os.getpid(), signal.SIGINT)


def test_train_again_after_ctrl_c_runs_at_the_chosen_limit(tmp_path):
    sim, opt, work, trainer = setup(tmp_path, MLP(), handle_signals=True)
    trainer.add_callback(CtrlC(opt))
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert opt.state is State.DONE and sim.gpus[0].power_limit_w() == PRESET_W  # the guard restored
        chosen = opt.chosen_limit_w
        first_run = len(work.seen)
        trainer.train()  # again, in the same process
    finally:
        opt.restore()
    second = work.seen[first_run:]
    assert len(second) == 220 and set(second) == {(State.DONE, chosen)}
    assert sim.gpus[0].power_limit_w() == PRESET_W and opt.guard.changed == []


def test_checkpoints_just_before_epoch_ends_do_not_shorten_the_next_warmup(tmp_path):
    # 11 steps per epoch and a checkpoint every 10 steps: the last pause before an epoch end
    # can be 1 step before it; every epoch must still start with 4 warm-up steps.
    args_kw = {"save_strategy": "steps", "save_steps": 10, "save_only_model": True, "eval_strategy": "epoch"}
    sim, opt, work, trainer = setup(tmp_path, MLP(), epochs=8, args_kw=args_kw, warmup_steps=4,
                                    profile_steps=30)
    trainer.train()
    states = [state for state, _ in work.seen]  # while each step ran
    assert len(states) == 88 and State.DONE not in states
    for epoch in range(8):
        first = states[11 * epoch:11 * epoch + 4]
        assert first == [State.WARMUP] * 4, (epoch, first)
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth(limit).time_s, rel=1e-2)


CRASHING_JOB = textwrap.dedent("""
    import sys
    from pathlib import Path

    sys.path.insert(0, sys.argv[1])
    import test_huggingface as t

    # The state file makes the simulated GPU's limit outlive this process, like a real GPU's.
    sim, opt, work, trainer = t.setup(Path(sys.argv[2]), t.MLP(fail_after=12), state_file=sys.argv[3])
    try:
        trainer.train()  # raises; no `with optimizer:` here
    finally:
        print("limits during training:", sorted({limit for _, limit in work.seen}))
""")


def test_uncaught_exception_without_context_restores_at_interpreter_exit(tmp_path):
    """Without ``with optimizer:``, the restore guard's atexit hook puts the limit back."""
    from joules.devices.sim.state import SimStateFile

    state_file = tmp_path / "gpus.json"
    env_dir = tmp_path / "state"
    r = subprocess.run(
        [sys.executable, "-c", CRASHING_JOB, str(Path(__file__).parent), str(tmp_path), str(state_file)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JOULES_STATE_DIR": str(env_dir)},
    )
    assert r.returncode == 1 and "boom" in r.stderr, r.stderr[-3000:]
    seen = r.stdout.split("limits during training:")[1]
    assert "400.0" in seen  # the limit had been changed when the job crashed
    assert SimStateFile(state_file).load()["0"]["power_limit_w"] == PRESET_W


class OutOfMemoryOnce(MLP):
    """Runs out of memory once, at its 16th training step (as a long batch might)."""

    def forward(self, x, labels=None):
        if self.training and self.train_calls == 15:
            self.train_calls += 1
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x, labels)


def test_a_smaller_batch_size_after_running_out_of_memory_is_profiled_afresh(tmp_path):
    """``auto_find_batch_size`` trains again at a smaller batch size after running out of memory:
    the points measured at 16 were kept and mixed with those at 14 (about 12 % faster), the choice
    made on them (225 W, 1.24x slower for a 1.1x budget) and saved for the next job."""
    sim, opt, work, trainer = setup(tmp_path, OutOfMemoryOnce(), args_kw={
        "auto_find_batch_size": True, "eval_strategy": "no"}, selector="slowdown:1.1", search="sweep",
        workload="mlp", store=tmp_path / "profiles")
    sizes: list[int] = []

    class BatchWork(transformers.TrainerCallback):  # a step's work grows with its batch
        def on_step_end(self, args, state, control, **kwargs):
            sizes.append(state.train_batch_size)
            work.seen.append((opt.state, sim.gpus[0].power_limit_w()))
            sim.run(WORK_S * state.train_batch_size / 16, CF)

    trainer.callback_handler.callbacks = [BatchWork(), *(c for c in trainer.callback_handler.callbacks
                                                         if not isinstance(c, SimWork))]
    trainer.train()
    assert sizes[0] == 16 and sizes[-1] < 16
    scale = sizes[-1] / 16
    for limit, p in opt.points.items():  # every point measured at the batch size trained last
        assert p.time_s == pytest.approx(truth(limit).time_s * scale, rel=1e-2)
    budget = 1.1 * truth(max(opt.points)).time_s
    assert opt.chosen_limit_w == min((x for x in opt.points if truth(x).time_s <= budget),
                                     key=lambda x: truth(x).energy_j)
    assert not any((tmp_path / "profiles").rglob("*.json"))  # not saved as the workload's
    assert sim.gpus[0].power_limit_w() == PRESET_W
