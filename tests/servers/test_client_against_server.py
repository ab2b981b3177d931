"""The batch-size client end to end against the real server (``joules serve`` in a subprocess).

Each recurrence of a job trains on a simulated A100 (virtual clock): an epoch is a pass over
a fixed number of samples, so a larger batch makes fewer, longer steps; the validation metric
reaches the target after a number of epochs that depends on the batch size. The cheapest
batch size to reach the target is therefore known in advance (64 here), and the server's
policy must converge to it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from joules.devices.sim import Constant, Simulator
from joules.errors import JoulesError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.batch_size.client import BatchSizeOptimizer, ServerError
from joules.optimizers.batch_size.types import trial_cost
from joules.servers.batch_size.schemas import JobState, TrialOut

for _module in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "prometheus_client"):
    pytest.importorskip(_module)

TOKEN = "test-token"
CF = 0.8
SAMPLES = 2048  # per epoch
OVERHEAD_S, PER_SAMPLE_S = 0.05, 0.001  # step time: OVERHEAD_S + PER_SAMPLE_S * batch size
EVAL_S = 1.0
EPOCHS_TO_TARGET = {16: 6, 32: 4, 64: 3, 128: 5, 256: 20}  # 256 never gets there (max_epochs 7)
BEST = 64  # cost ~ time to target: 16: 57 s, 32: 25 s, 64: 14 s, 128: 19 s, 256: fails
PL = {"handle_signals": False, "warmup_steps": 2, "profile_steps": 5}


def job_spec(name: str, **kw: Any) -> dict[str, Any]:
    spec = {"name": name, "batch_sizes": [16, 32, 64, 128, 256], "default_batch_size": 128,
            "target_metric": 1.0, "max_epochs": 7, "max_power_w": 400.0, "eta": 0.5, "beta": 2.0, "seed": 1}
    spec.update(kw)
    return spec


# -- the server ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("bso-server")
    port = _free_port()
    env = dict(os.environ, JOULES_STATE_DIR=str(tmp / "state"))
    env.pop("JOULES_SERVER_DB", None)
    log = (tmp / "server.log").open("w")
    joules_bin = Path(sys.executable).with_name("joules")
    proc = subprocess.Popen(
        [str(joules_bin), "serve", "--db", f"sqlite:///{tmp / 'bso.sqlite'}", "--host", "127.0.0.1",
         "--port", str(port), "--token", TOKEN, "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60.0
        while True:
            if proc.poll() is not None:
                pytest.fail(f"joules serve exited ({proc.returncode}):\n{(tmp / 'server.log').read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"joules serve did not answer in 60 s:\n{(tmp / 'server.log').read_text()}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def get(url: str, path: str) -> Any:
    r = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10.0)
    r.raise_for_status()
    return r.json()


# -- a recurrence ----------------------------------------------------------------------------
def recurrence(url: str, spec: dict[str, Any], rng: random.Random, crash_after: int | None = None,
               **kw: Any) -> BatchSizeOptimizer:
    """One run of the job, on fresh simulated hardware, until the client says stop."""
    sim = Simulator("A100")
    monitor = EnergyMonitor(devices=sim.devices())
    sim.advance(10.0)  # the job starts up
    sim.set_workload(Constant(1.0), cpus=False)
    kw.setdefault("power_limit", PL)
    bso = BatchSizeOptimizer(monitor, url, spec, token=TOKEN, backoff_s=0.05, **kw)
    try:
        with bso:
            bs = bso.get_batch_size()
            bso.on_train_begin()
            for epoch in range(1, spec["max_epochs"] + 1):
                bso.on_epoch_begin()
                for _ in range(SAMPLES // bs):
                    bso.on_step_begin()
                    sim.run((OVERHEAD_S + PER_SAMPLE_S * bs) * rng.uniform(0.98, 1.02), CF)
                    bso.on_step_end()
                bso.on_epoch_end()
                if crash_after == epoch:
                    raise RuntimeError("simulated crash")
                sim.set_workload(Constant(0.3), cpus=False)
                sim.advance(EVAL_S)
                sim.set_workload(Constant(1.0), cpus=False)
                if bso.on_evaluate(min(1.0, epoch / EPOCHS_TO_TARGET[bs])):
                    break
    except RuntimeError as e:
        if crash_after is None or "simulated crash" not in str(e):
            raise
    finally:
        bso.close()
        monitor.close()
    return bso


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["joules", "nsdi23"])
def test_recurring_job_converges_to_the_cheapest_batch_size(server: str, policy: str):
    spec = job_spec(f"sim/resnet-converges-{policy}", policy=policy)
    rng = random.Random(0)
    runs = [recurrence(server, spec, rng, crash_after=2 if k == 9 else None) for k in range(22)]

    job_id = runs[0].job.job_id if runs[0].job else ""
    assert all(r.job is not None and r.job.job_id == job_id for r in runs)  # one job, registered once
    trials = [TrialOut.model_validate(t) for t in get(server, f"/jobs/{job_id}/trials")]
    state = JobState.model_validate(get(server, f"/jobs/{job_id}"))

    # The server's history is the clients' history.
    assert [t.trial_id for t in trials] == [r.trial.trial_id for r in runs if r.trial]
    for run, t in zip(runs, trials, strict=True):
        assert run.trial == t and t.status == "ended"
        reports = [e.report for e in run.epochs]
        assert t.epochs == len(reports)
        assert t.time_s == pytest.approx(sum(e.time_s for e in reports), rel=1e-12)
        assert t.energy_j == pytest.approx(sum(e.energy_j for e in reports), rel=1e-12)
        assert t.cost == pytest.approx(trial_cost(0.5, 400.0, t.energy_j, t.time_s), rel=1e-12)
        if t.outcome != "aborted":
            assert run.stop_reason == t.outcome
            assert [e.answer.stop for e in run.epochs] == [False] * (t.epochs - 1) + [True]
    assert trials[9].outcome == "aborted" and trials[9].epochs == 1

    # Outcomes follow the synthetic truth.
    for t in trials:
        if t.outcome == "reached":
            assert t.epochs == EPOCHS_TO_TARGET[t.batch_size]
        elif t.outcome == "max_epochs":
            assert t.epochs == spec["max_epochs"]
    assert not any(t.outcome == "reached" for t in trials if t.batch_size == 256)
    outcomes = Counter(t.outcome for t in trials)
    assert state.trials == {"running": 0, "ended": len(trials), **outcomes}
    assert outcomes["reached"] >= 15 and outcomes["aborted"] == 1

    # The batch sizes around the best were explored, the failing ones pruned, and the policy
    # settled on the cheapest.
    assert {32, 64, 128} <= {t.batch_size for t in trials}
    assert BEST in state.surviving and 256 not in state.surviving
    assert all(state.explored[b] == "failed" for b in (16, 256) if b in state.explored)
    assert state.best_batch_size == BEST
    assert min(state.posterior, key=lambda b: state.posterior[b].mean) == BEST
    assert state.phase == "exploit"
    last = [t.batch_size for t in trials[-8:]]
    assert last.count(BEST) >= 6, last
    mean_cost = {b: sum(t.cost for t in trials if t.batch_size == b and t.outcome == "reached")
                 / max(1, sum(1 for t in trials if t.batch_size == b and t.outcome == "reached"))
                 for b in (32, 64, 128)}
    assert min(mean_cost, key=mean_cost.__getitem__) == BEST

    # The power-limit profile of a batch size is made by its first trial and reused after.
    seen: set[int] = set()
    for run in runs:
        plo = run.power_limit_optimizer
        assert plo is not None and run.batch_size is not None
        if plo.chosen_limit_w is None:  # the crashed trial may not have finished profiling
            continue
        assert plo.reused_profile == (run.batch_size in seen)
        seen.add(run.batch_size)


def test_the_real_server_names_the_fields_that_differ(server: str):
    recurrence(server, job_spec("sim/conflict"), random.Random(1), power_limit=False)
    with pytest.raises(ServerError) as info:
        recurrence(server, job_spec("sim/conflict", target_metric=0.9, beta=3.0), random.Random(1),
                   power_limit=False)
    assert info.value.status_code == 409
    message = str(info.value)
    assert "could not register the job 'sim/conflict'" in message and server in message
    assert "target_metric" in message and "beta" in message and "batch_sizes" not in message


def test_the_real_server_refuses_a_wrong_token_at_once(server: str):
    sim = Simulator("A100")
    monitor = EnergyMonitor(devices=sim.devices())
    bso = BatchSizeOptimizer(monitor, server, job_spec("sim/token"), token="wrong", power_limit=False,
                             backoff_s=0.05)
    sleeps: list[float] = []
    bso._sleep = sleeps.append
    with pytest.raises(ServerError, match="HTTP 401 \\(check the token") as info:
        bso.get_batch_size()
    assert info.value.status_code == 401 and sleeps == []
    monitor.close()


class _LoseFirstEpochAnswer(httpx.BaseTransport):
    """Forwards every request; the first epoch report's answer is lost on the way back."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/epochs") and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("answer lost", request=request)
        return response


def test_a_lost_epoch_answer_is_retried_and_counted_once(server: str):
    transport = _LoseFirstEpochAnswer()
    bso = recurrence(server, job_spec("sim/lost-answer"), random.Random(2), power_limit=False,
                     transport=transport)
    assert transport.lost == 1
    assert bso.trial is not None and bso.trial.outcome == "reached"
    [t] = [TrialOut.model_validate(x) for x in get(server, f"/jobs/{bso.trial.job_id}/trials")]
    assert t.epochs == len(bso.epochs) == EPOCHS_TO_TARGET[t.batch_size]
    assert t.time_s == pytest.approx(sum(e.report.time_s for e in bso.epochs), rel=1e-12)
    metrics = httpx.get(f"{server}/metrics", timeout=10.0).text
    assert 'joules_bso_epoch_reports_total{kind="repeated"}' in metrics


def test_reporting_after_the_trial_ended_elsewhere_is_a_clear_error(server: str):
    sim = Simulator("A100")
    monitor = EnergyMonitor(devices=sim.devices())
    bso = BatchSizeOptimizer(monitor, server, job_spec("sim/ended"), token=TOKEN, power_limit=False)
    bso.get_batch_size()
    bso.on_train_begin()
    sim.run(5.0, CF)
    assert bso.trial is not None
    r = httpx.post(f"{server}/jobs/{bso.trial.job_id}/trials/{bso.trial.trial_id}/end",
                   json={"status": "aborted"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    with pytest.raises(ServerError, match="could not report epoch 1: .* answered HTTP 409: .*has ended"):
        bso.on_evaluate(0.5)
    bso.on_train_end()  # ending it again changes nothing
    assert bso.trial.outcome == "aborted"
    with pytest.raises(JoulesError, match=r"call get_batch_size\(\) first"):
        bso.on_step_end()
    monitor.close()


class _LoseTrialAnswers(httpx.BaseTransport):
    """Forwards every request; the answers to the first ``n`` trial creations are lost on the way back."""

    def __init__(self, n: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.n = n
        self.creates: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method == "POST" and request.url.path.endswith("/trials"):
            self.creates.append(request.content)
            if len(self.creates) <= self.n:
                response.read()
                response.close()
                raise httpx.ReadTimeout("answer lost", request=request)
        return response


def _client(server: str, name: str,
            transport: httpx.BaseTransport) -> tuple[BatchSizeOptimizer, EnergyMonitor]:
    sim = Simulator("A100")
    monitor = EnergyMonitor(devices=sim.devices())
    bso = BatchSizeOptimizer(monitor, server, job_spec(name), token=TOKEN, power_limit=False, retries=2,
                             backoff_s=0.01, transport=transport)
    return bso, monitor


def test_a_trial_whose_every_create_answer_was_lost_is_handed_back_not_made_twice(server: str):
    transport = _LoseTrialAnswers(3)  # every attempt of the first get_batch_size()
    bso, monitor = _client(server, "sim/lost-create", transport)
    with pytest.raises(ServerError, match="could not create a trial: .* failed 3 time"):
        bso.get_batch_size()
    assert bso.job is not None
    [made] = [TrialOut.model_validate(t) for t in get(server, f"/jobs/{bso.job.job_id}/trials")]
    assert made.status == "running"
    bso.get_batch_size()
    trials = [TrialOut.model_validate(t) for t in get(server, f"/jobs/{bso.job.job_id}/trials")]
    assert [t.trial_id for t in trials] == [made.trial_id]  # one trial, not a second one running
    assert bso.trial is not None and bso.trial.trial_id == made.trial_id
    assert len(set(transport.creates)) == 1 and len(transport.creates) == 4
    state = JobState.model_validate(get(server, f"/jobs/{bso.job.job_id}"))
    assert state.trials == {"running": 1, "ended": 0}
    bso.abort()
    bso.close()
    monitor.close()


def test_abort_after_every_create_answer_was_lost_ends_the_trial_the_server_made(server: str):
    transport = _LoseTrialAnswers(3)
    bso, monitor = _client(server, "sim/lost-create-abort", transport)
    with pytest.raises(ServerError, match="could not create a trial"), bso:
        bso.get_batch_size()  # the with block's exit aborts
    assert bso.job is not None
    [t] = [TrialOut.model_validate(x) for x in get(server, f"/jobs/{bso.job.job_id}/trials")]
    assert t.status == "ended" and t.outcome == "aborted"
    assert bso.trial == t
    state = JobState.model_validate(get(server, f"/jobs/{bso.job.job_id}"))
    assert state.trials == {"running": 0, "ended": 1, "aborted": 1}
    bso.close()
    monitor.close()


_STOPPED_JOB = """
import os, signal, sys
from joules.devices.sim import Constant, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.batch_size.client import BatchSizeOptimizer

url, name, signum, state, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
mode = sys.argv[6]
sim = Simulator("A100", state_file=state)
sim.set_workload(Constant(1.0), cpus=False)
monitor = EnergyMonitor(devices=sim.devices())
if mode == "guard":  # a restore guard's handlers first (an asynchronous pipeline controller's do)
    from joules.devices.restore import RestoreGuard
    RestoreGuard(sim.gpus).install_signal_handlers()
for job in range(jobs):  # (a sweep: one client after the other in one process)
    if mode == "reset":  # a trainer that puts the handlers it found back at its end (Lightning)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if mode == "wrap" and job == 1:  # the program's own clean-up, passing the signal on to the old handler
        def clean_up(signum, frame, old=signal.getsignal(signum)):
            print("cleaned up", flush=True)
            old(signum, frame)
        signal.signal(signum, clean_up)
    spec = {"name": f"{name}/{job}", "batch_sizes": [16, 32, 64, 128, 256], "default_batch_size": 128,
            "target_metric": 1.0, "max_epochs": 7, "max_power_w": 400.0, "eta": 0.5, "beta": 2.0, "seed": 1}
    with BatchSizeOptimizer(monitor, url, spec, token="test-token",
                            power_limit={"warmup_steps": 2, "profile_steps": 5}) as bso:
        bso.get_batch_size()
        for step in range(1000):
            bso.on_step_begin()
            sim.run(0.1, 0.8)
            bso.on_step_end()
            if step == 10 and job == jobs - 1:
                print("limit", sim.gpus[0].power_limit_w(), flush=True)
                os.kill(os.getpid(), signum)  # the scheduler stops the job
            if step % 20 == 19 and bso.on_evaluate(1.0):
                break
"""


@pytest.mark.parametrize(("signum", "jobs", "mode"), [
    (15, 1, "plain"), (1, 1, "plain"),  # SIGTERM (scancel, an eviction), SIGHUP (a closed terminal)
    (15, 2, "plain"),  # a sweep: the second client took the first's handler for the program's
    (1, 2, "reset"),  # the handlers put back between the jobs: not installed again
    (15, 1, "guard"),  # a restore guard's handler first: taken for the program's
    (15, 2, "wrap"),  # the program's handler wraps the client's, installed again on top: a loop
])
def test_a_job_stopped_by_a_signal_aborts_its_trial(server: str, signum: int, jobs: int, mode: str,
                                                    tmp_path: Path):
    """The process died of the signal outside the with block: its trial stayed running for a
    day (its batch size in flight for the policy); the power limit was put back."""
    state = tmp_path / "sim.json"
    name = f"sim/signal-{signum}-{jobs}-{mode}"
    r = subprocess.run([sys.executable, "-c", _STOPPED_JOB, server, name, str(signum), str(state), str(jobs),
                        mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signum, r.stderr
    assert float(r.stdout.split("limit")[-1].split()[0]) < 400.0  # stopped while profiling a lower limit
    assert r.stdout.count("cleaned up") == (1 if mode == "wrap" else 0)
    for k in range(jobs):
        job = httpx.post(f"{server}/jobs", json=job_spec(f"{name}/{k}"),
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10.0).json()
        [trial] = get(server, f"/jobs/{job['job_id']}/trials")
        assert (trial["status"], trial["outcome"]) == ("ended", "reached" if k < jobs - 1 else "aborted")
    assert json.loads(state.read_text())["gpus"]["0"]["power_limit_w"] == 400.0  # put back


_FORKING_JOB = """
import os, signal, sys, time
from joules.devices.sim import Constant, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.batch_size.client import BatchSizeOptimizer

url, name = sys.argv[1], sys.argv[2]
sim = Simulator("A100")
sim.set_workload(Constant(1.0), cpus=False)
spec = {"name": name, "batch_sizes": [16, 32, 64, 128, 256], "default_batch_size": 128,
        "target_metric": 1.0, "max_epochs": 7, "max_power_w": 400.0, "eta": 0.5, "beta": 2.0, "seed": 1}
with BatchSizeOptimizer(EnergyMonitor(devices=sim.devices()), url, spec, token="test-token",
                        power_limit=False) as bso:
    bso.get_batch_size()
    for step in range(20):
        bso.on_step_begin()
        sim.run(0.1, 0.8)
        bso.on_step_end()
    pid = os.fork()  # a helper process (a data loader's worker, say), stopped with SIGTERM
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    os.kill(pid, signal.SIGTERM)
    print("helper", os.waitpid(pid, 0)[1], flush=True)
    print("stop", bso.on_evaluate(1.0), flush=True)
pid = os.fork()  # a worker forked after the parent's trial, that runs a trial of its own, stopped
if pid == 0:
    with BatchSizeOptimizer(EnergyMonitor(devices=sim.devices()), url, {**spec, "name": name + "/worker"},
                            token="test-token", power_limit=False) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    os._exit(3)
print("worker", os.waitpid(pid, 0)[1], flush=True)
"""


def test_a_forked_helper_stopped_by_sigterm_leaves_the_parents_trial_alone(server: str):
    """A forked child inherited the handler and, stopped, ended the parent's trial as aborted:
    the parent's next report got 409."""
    name = "sim/forked-helper"
    r = subprocess.run([sys.executable, "-c", _FORKING_JOB, server, name], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "stop True" in r.stdout
    job = httpx.post(f"{server}/jobs", json=job_spec(name), headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=10.0).json()
    [trial] = get(server, f"/jobs/{job['job_id']}/trials")
    assert (trial["status"], trial["outcome"]) == ("ended", "reached")
    assert f"worker {int(signal.SIGTERM)}" in r.stdout  # died of the signal (it recursed into its handler)
    job = httpx.post(f"{server}/jobs", json=job_spec(name + "/worker"),
                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10.0).json()
    [trial] = get(server, f"/jobs/{job['job_id']}/trials")
    assert (trial["status"], trial["outcome"]) == ("ended", "aborted")


_SIGNAL_IN_A_GUARD_OPERATION = """
import signal, sys
import joules.devices.restore as restore
from joules.devices.sim import Constant, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.batch_size.client import BatchSizeOptimizer

url, name, state = sys.argv[1], sys.argv[2], sys.argv[3]
sim = Simulator("A100", state_file=state)
sim.set_workload(Constant(1.0), cpus=False)
spec = {"name": name, "batch_sizes": [16, 32, 64, 128, 256], "default_batch_size": 128,
        "target_metric": 1.0, "max_epochs": 7, "max_power_w": 400.0, "eta": 0.5, "beta": 2.0, "seed": 1}
write = restore._write_json_atomic

def stopped_while_writing(path, data):  # the scheduler stops the job while the guard journals
    restore._write_json_atomic = write
    signal.raise_signal(signal.SIGTERM)
    return write(path, data)

restore._write_json_atomic = stopped_while_writing
with BatchSizeOptimizer(EnergyMonitor(devices=sim.devices()), url, spec, token="test-token",
                        power_limit={"warmup_steps": 2, "profile_steps": 5}) as bso:
    bso.get_batch_size()
    for step in range(100000):
        bso.on_step_begin()
        sim.run(0.1, 0.8)
        bso.on_step_end()
"""


def test_a_signal_during_a_restore_guards_operation_is_handled_once_it_is_over(server: str, tmp_path: Path):
    """The client's handler put the GPUs back at once, waiting on the journal directory's lock
    that the interrupted guard held: the process hung until SIGKILL, the GPU lowered."""
    state = tmp_path / "sim.json"
    name = "sim/signal-in-guard"
    r = subprocess.run([sys.executable, "-c", _SIGNAL_IN_A_GUARD_OPERATION, server, name, str(state)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr
    job = httpx.post(f"{server}/jobs", json=job_spec(name), headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=10.0).json()
    [trial] = get(server, f"/jobs/{job['job_id']}/trials")
    assert (trial["status"], trial["outcome"]) == ("ended", "aborted")
    assert json.loads(state.read_text())["gpus"]["0"]["power_limit_w"] == 400.0
