"""The batch-size optimizer client against a fake server (httpx.MockTransport), on simulated GPUs."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

import joules
from joules.devices.sim import Constant, Simulator
from joules.errors import JoulesError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.batch_size.client import BatchSizeOptimizer, ServerError
from joules.optimizers.batch_size.types import trial_cost
from joules.servers.batch_size.schemas import (
    EpochAnswer,
    EpochReport,
    JobCreate,
    JobOut,
    TrialCreate,
    TrialEnd,
    TrialOut,
)

URL = "http://bso.test:7787"
WORK_S = 0.2  # per step at batch size 1 unit of work
CF = 0.8
JOB = {
    "name": "resnet/cifar10", "batch_sizes": [256, 32, 64, 128], "default_batch_size": 64,
    "target_metric": 0.9, "max_epochs": 6, "max_power_w": 400.0, "eta": 0.5,
}
COUNTER_J = 0.1 * 400.0  # one update of an A100's energy counter at full power
FAST_PL = {"handle_signals": False, "warmup_steps": 2, "profile_steps": 5}


# -- a fake server ---------------------------------------------------------------------------
class FakeServer:
    """The endpoints of schemas.py, in memory; records requests; can fail on demand.

    ``failures`` is consumed one per request: ``"connect"`` (connection error), ``"timeout"``
    (read timeout before the server sees it), ``"garbled"`` (an answer httpx cannot decode),
    ``"lost"`` (the server handles it, the answer is lost: a read timeout), an int status
    (answered without handling), or ``None`` (handled).
    """

    def __init__(self, token: str | None = None, choose: Callable[[dict], int] | None = None) -> None:
        self.token = token
        self.choose = choose or (lambda job: job["default_batch_size"])
        self.jobs: dict[str, dict[str, Any]] = {}  # job_id -> JobOut json
        self.trials: dict[str, dict[str, Any]] = {}
        self.request_ids: dict[str, str] = {}
        self.epochs: dict[str, dict[int, tuple[dict, dict]]] = {}
        self.requests: list[httpx.Request] = []
        self.failures: list[str | int | None] = []
        self.retry_after = "3"  # the Retry-After of an injected 429, s

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def bodies(self, method: str, suffix: str) -> list[dict]:
        return [json.loads(r.content) for r in self.requests
                if r.method == method and r.url.path.endswith(suffix)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        action = self.failures.pop(0) if self.failures else None
        if action == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if action == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if action == "garbled":  # e.g. a proxy's broken compression
            raise httpx.DecodingError("bad gzip stream", request=request)
        if isinstance(action, int):
            return httpx.Response(action, json={"detail": f"injected {action}"},
                                  headers={"Retry-After": self.retry_after} if action == 429 else {})
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return httpx.Response(401, json={"detail": "missing or wrong bearer token"})
        response = self.handle(request)
        if action == "lost":
            raise httpx.ReadTimeout("answer lost", request=request)
        return response

    def handle(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        body = json.loads(request.content) if request.content else None
        now = datetime.now(UTC).isoformat()
        if request.method == "POST" and parts == ["jobs"]:
            spec = JobCreate.model_validate(body)
            assert body == spec.model_dump(mode="json", exclude_unset=True), "sent as given"
            for job in self.jobs.values():
                if job["name"] == spec.name:
                    mine = {k: v for k, v in job.items() if k not in ("job_id", "created_at")}
                    given = spec.model_dump(mode="json")
                    if mine != given:  # worded as the real server words it
                        differ = ", ".join(k for k in mine if mine[k] != given[k])
                        return httpx.Response(409, json={"detail": (
                            f"job {spec.name!r} is already registered with another spec (differs in: "
                            f"{differ}); register under a new name")})
                    return httpx.Response(200, json=job)
            job_id = f"j{len(self.jobs) + 1}"
            out = JobOut(**spec.model_dump(), job_id=job_id, created_at=now)
            self.jobs[job_id] = out.model_dump(mode="json")
            return httpx.Response(201, json=self.jobs[job_id])
        if request.method == "POST" and len(parts) == 3 and parts[2] == "trials":
            create = TrialCreate.model_validate(body)
            job = self.jobs[parts[1]]
            if create.request_id in self.request_ids:  # a retry: the same trial again
                return httpx.Response(200, json=self.trials[self.request_ids[create.request_id]])
            trial_id = f"t{len(self.trials) + 1}"
            if create.request_id is not None:
                self.request_ids[create.request_id] = trial_id
            self.trials[trial_id] = TrialOut(
                trial_id=trial_id, job_id=parts[1], batch_size=self.choose(job), phase="explore",
                stop_cost=None, status="running", created_at=now).model_dump(mode="json")
            self.epochs[trial_id] = {}
            return httpx.Response(201, json=self.trials[trial_id])
        if request.method == "POST" and len(parts) == 5 and parts[4] == "epochs":
            report = EpochReport.model_validate(body)
            job, trial = self.jobs[parts[1]], self.trials[parts[3]]
            seen = self.epochs[parts[3]]
            if report.epoch in seen:
                if seen[report.epoch][0] != body:
                    return httpx.Response(409, json={"detail": f"epoch {report.epoch} reported differently"})
                return httpx.Response(200, json=seen[report.epoch][1])
            if trial["status"] == "ended":
                return httpx.Response(409, json={"detail": "trial has ended"})
            trial["epochs"] = report.epoch
            trial["time_s"] += report.time_s
            trial["energy_j"] += report.energy_j
            trial["cost"] = trial_cost(job["eta"], job["max_power_w"], trial["energy_j"], trial["time_s"])
            better = report.metric >= job["target_metric"] if job["higher_is_better"] else \
                report.metric <= job["target_metric"]
            reason = "reached" if better else "max_epochs" if report.epoch >= job["max_epochs"] else None
            answer = EpochAnswer(stop=reason is not None, reason=reason, cost=trial["cost"])
            answer = answer.model_dump(mode="json")
            if reason is not None:  # the answer to stop ends the trial
                trial.update(status="ended", outcome=reason, ended_at=now)
            seen[report.epoch] = (body, answer)
            return httpx.Response(200, json=answer)
        if request.method == "POST" and len(parts) == 5 and parts[4] == "end":
            end = TrialEnd.model_validate(body)
            trial = self.trials[parts[3]]
            if trial["status"] == "running":  # ending an ended trial changes nothing
                aborted = end.status == "aborted" or trial["epochs"] == 0
                outcome = "failed" if end.status == "failed" else "aborted" if aborted else "max_epochs"
                trial.update(status="ended", outcome=outcome, ended_at=now)
            return httpx.Response(200, json=trial)
        return httpx.Response(404, json={"detail": f"no route {request.method} {request.url.path}"})


# -- simulated training ----------------------------------------------------------------------
def make_sim(spec: str = "A100", **gpu_kw: Any) -> tuple[Simulator, EnergyMonitor]:
    sim = Simulator(spec)
    for g in sim.gpus:
        for k, v in gpu_kw.items():
            setattr(g, k, v)
    monitor = EnergyMonitor(devices=sim.devices())
    sim.advance(30.0)  # idle while the job starts (the sampler learns the counters' phases)
    sim.set_workload(Constant(1.0), cpus=False)
    return sim, monitor


def make_client(monitor: EnergyMonitor, server: FakeServer, job: dict | None = None, **kw: Any):
    kw.setdefault("power_limit", FAST_PL)
    kw.setdefault("backoff_s", 0.0)
    bso = BatchSizeOptimizer(monitor, URL, job or JOB, transport=server.transport(), **kw)
    sleeps: list[float] = []
    bso._sleep = sleeps.append
    return bso, sleeps


def started_trial() -> tuple[FakeServer, Simulator, BatchSizeOptimizer]:
    """A client (no power-limit search) whose first trial has begun training."""
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    bso.get_batch_size()
    bso.on_train_begin()
    return server, sim, bso


def truth_now(sim: Simulator) -> tuple[float, float]:
    return sim.clock.now(), sum(sim.true_gpu_energy_j().values())


def train(bso: BatchSizeOptimizer, sim: Simulator, metrics: list[float], steps: int = 30,
          eval_s: float = 5.0) -> list[tuple[float, float]]:
    """Train until the client says stop; return the true (time, energy) of each epoch."""
    bs = bso.get_batch_size()
    bso.on_train_begin()
    truths = []
    t0, e0 = truth_now(sim)
    for metric in metrics:
        bso.on_epoch_begin()
        for _ in range(steps):
            bso.on_step_begin()
            sim.run(WORK_S * bs / 64, CF)
            bso.on_step_end()
        bso.on_epoch_end()
        sim.set_workload(Constant(0.3), cpus=False)  # evaluation: part of the epoch's cost
        sim.advance(eval_s)
        sim.set_workload(Constant(1.0), cpus=False)
        t1, e1 = truth_now(sim)
        truths.append((t1 - t0, e1 - e0))
        t0, e0 = t1, e1
        if bso.on_evaluate(metric):
            break
    bso.on_train_end()
    return truths


# -- tests -----------------------------------------------------------------------------------
def test_exported_lazily_from_joules():
    assert joules.BatchSizeOptimizer is BatchSizeOptimizer
    assert "BatchSizeOptimizer" in joules.__all__


def test_request_bodies_follow_the_schema_exactly():
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, client_name="host-a:run-7")
    assert bso.get_batch_size() == 64
    assert bso.get_batch_size() == 64  # cached: one registration, one trial
    train(bso, sim, [0.5, 0.95])

    [job] = server.bodies("POST", "/jobs")
    assert JobCreate.model_validate(job) == JobCreate.model_validate(JOB)  # defaults left to the server
    assert job["batch_sizes"] == [32, 64, 128, 256]
    [create] = server.bodies("POST", "/trials")
    assert create["client"] == "host-a:run-7" and len(create.pop("request_id")) == 32 and create == {
        "client": "host-a:run-7"}
    epochs = server.bodies("POST", "/epochs")
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert all(set(e) == {"epoch", "time_s", "energy_j", "metric"} for e in epochs)
    assert [e["metric"] for e in epochs] == [0.5, 0.95]
    assert server.bodies("POST", "/end") == [{"status": "completed"}]
    assert [r.headers["content-type"] for r in server.requests] == ["application/json"] * 5
    assert bso.trial is not None and bso.trial.outcome == "reached" and bso.trial.status == "ended"
    assert bso.stop_reason == "reached" and bso.epoch == 2


class NewerServer(FakeServer):
    """A server of a later version: its answers carry a field this client does not know."""

    def handle(self, request: httpx.Request) -> httpx.Response:
        response = super().handle(request)
        if response.status_code >= 400:
            return response
        return httpx.Response(response.status_code, json={**response.json(), "added_later": [1, 2]})


def test_a_client_and_a_server_of_other_versions_understand_each_other():
    """A field added to an answer broke every older client (its models refused unknown fields),
    and a client sending every default broke on an older server that lacks the newer ones."""
    server = NewerServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    assert bso.get_batch_size() == 64
    train(bso, sim, [0.5, 0.95])
    assert bso.stop_reason == "reached" and bso.trial is not None and bso.trial.status == "ended"
    # Only what the job gave is sent: an older server's models know those fields.
    [job] = server.bodies("POST", "/jobs")
    assert set(job) == set(JOB)


def test_epoch_time_and_energy_are_the_simulators_truth():
    server = FakeServer()
    sim, monitor = make_sim("A100x2")
    bso, _ = make_client(monitor, server)
    truths = train(bso, sim, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    reports = [EpochReport.model_validate(b) for b in server.bodies("POST", "/epochs")]
    assert len(reports) == 6 == len(truths)  # max_epochs
    assert bso.stop_reason == "max_epochs" and bso.trial is not None and bso.trial.outcome == "max_epochs"
    for r, (t, e) in zip(reports, truths, strict=True):
        assert r.time_s == pytest.approx(t, rel=1e-9, abs=1e-9)
        # Each epoch's edges fall on a power step (training starts, evaluation ends), which
        # the monitor interpolates across one counter update (0.1 s): within a quarter of an
        # update at full power per GPU, i.e. 0.2% of the epoch here.
        assert r.energy_j == pytest.approx(e, abs=2 * COUNTER_J / 4)
    # The first epochs profiled power limits (their energy is in the trial's), later ones ran
    # at the chosen limit.
    plo = bso.power_limit_optimizer
    assert plo is not None and plo.chosen_limit_w is not None and len(plo.points) >= 2
    assert plo.workload == "resnet/cifar10/bs64" and repr(plo.selector) == "cost:0.5"
    total_t, total_e = map(sum, zip(*truths, strict=True))
    assert bso.trial.time_s == pytest.approx(total_t, rel=1e-9)
    assert bso.trial.energy_j == pytest.approx(total_e, rel=2e-3)
    assert [g.power_limit_w() for g in sim.gpus] == [400.0, 400.0]  # restored at the end


def test_power_limit_profile_is_reused_by_the_next_trial_with_the_same_batch_size():
    server = FakeServer()
    sim, monitor = make_sim()
    first, _ = make_client(monitor, server)
    train(first, sim, [0.5, 0.6, 0.95])
    plo1 = first.power_limit_optimizer
    assert plo1 is not None and not plo1.reused_profile and plo1.chosen_limit_w is not None

    sim2, monitor2 = make_sim()  # the next recurrence, another process
    second, _ = make_client(monitor2, server)
    limits: list[float] = []
    second.get_batch_size()
    second.on_train_begin()
    for _ in range(10):
        second.on_step_begin()
        limits.append(sim2.gpus[0].power_limit_w())
        sim2.run(WORK_S, CF)
        second.on_step_end()
    second.on_evaluate(0.95)
    second.on_train_end()
    plo2 = second.power_limit_optimizer
    assert plo2 is not None and plo2.reused_profile
    assert plo2.chosen_limit_w == plo1.chosen_limit_w
    assert set(limits) == {plo1.chosen_limit_w}  # no profiling: the chosen limit from the first step
    assert len(server.jobs) == 1 and len(server.trials) == 2


def test_a_different_batch_size_profiles_again():
    sizes = iter([64, 128])
    server = FakeServer(choose=lambda job: next(sizes))
    sim, monitor = make_sim()
    first, _ = make_client(monitor, server)
    train(first, sim, [0.95])
    second, _ = make_client(monitor, server)
    train(second, sim, [0.5, 0.6, 0.95])
    assert second.batch_size == 128
    assert second.power_limit_optimizer is not None
    assert not second.power_limit_optimizer.reused_profile
    assert second.power_limit_optimizer.workload == "resnet/cifar10/bs128"


def test_retries_a_connection_error_then_succeeds():
    server = FakeServer()
    server.failures = ["connect", None]
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, backoff_s=0.5)
    assert bso.get_batch_size() == 64
    assert len(server.requests) == 3 and len(server.jobs) == 1
    assert len(sleeps) == 1 and 0.5 <= sleeps[0] <= 0.55


def test_retries_503_twice_with_exponential_backoff():
    server = FakeServer()
    server.failures = [503, 503]
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, backoff_s=0.5)
    assert bso.get_batch_size() == 64
    assert [r.url.path for r in server.requests] == ["/jobs", "/jobs", "/jobs", "/jobs/j1/trials"]
    assert len(sleeps) == 2
    assert 0.5 <= sleeps[0] <= 0.55 and 1.0 <= sleeps[1] <= 1.1


def test_429_is_retried_and_retry_after_is_honored():
    server = FakeServer()
    server.failures = [429]
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, backoff_s=0.0)
    bso.get_batch_size()
    assert sleeps == [3.0] and len(server.jobs) == 1  # backoff 0: the wait is the server's Retry-After


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_4xx_are_never_retried(status: int):
    server = FakeServer()
    server.failures = [status]
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server)
    expected = rf"^could not register the job: POST {URL}/jobs answered HTTP {status}"
    with pytest.raises(ServerError, match=expected):
        bso.get_batch_size()
    assert len(server.requests) == 1 and sleeps == []


def test_a_validation_error_lists_the_fields():
    server = FakeServer()
    original = server.handle

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/jobs":
            return httpx.Response(422, json={"detail": [
                {"type": "value_error", "loc": ["body", "batch_sizes"], "msg": "too many", "input": None},
                {"type": "missing", "loc": ["body", "eta"], "msg": "Field required", "input": None}]})
        return original(request)

    server.handle = refuse  # type: ignore[method-assign]
    _, monitor = make_sim()
    with pytest.raises(ServerError, match="HTTP 422: body.batch_sizes: too many; body.eta: Field required$"):
        make_client(monitor, server)[0].get_batch_size()


def test_the_last_retry_error_names_the_url_and_the_failure():
    server = FakeServer()
    server.failures = [503] * 3
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, retries=2)
    with pytest.raises(ServerError) as info:
        bso.get_batch_size()
    message = str(info.value)
    assert f"POST {URL}/jobs" in message and "failed 3 time(s)" in message and "HTTP 503" in message
    assert info.value.status_code == 503 and len(sleeps) == 2

    server.failures = ["connect"] * 3
    with pytest.raises(ServerError, match="ConnectError: connection refused") as info:
        bso.get_batch_size()
    assert info.value.status_code is None

    server.failures = ["garbled"] * 3  # any other failure of httpx's is a ServerError too
    with pytest.raises(ServerError, match="DecodingError: bad gzip stream") as info:
        bso.get_batch_size()
    assert info.value.status_code is None
    server.failures = ["garbled"]
    assert bso.get_batch_size() == 64  # and retried like a lost connection


def test_a_lost_epoch_answer_is_retried_safely():
    server, sim, bso = started_trial()
    sim.run(10.0, CF)
    server.failures = ["lost"]  # the server records epoch 1, its answer never arrives
    assert bso.on_evaluate(0.5) is False
    epochs = server.bodies("POST", "/epochs")
    assert len(epochs) == 2 and epochs[0] == epochs[1]  # the same report, answered the same
    assert server.trials["t1"]["epochs"] == 1
    assert server.trials["t1"]["time_s"] == pytest.approx(10.0 * (1 - CF) + 10.0 * CF, rel=0.5)
    bso.on_train_end()


def test_timeouts_are_configured_on_every_request():
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, timeout_s=2.5)
    bso.get_batch_size()
    for r in server.requests:
        assert r.extensions["timeout"] == {"connect": 2.5, "read": 2.5, "write": 2.5, "pool": 2.5}


def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept connections, read nothing, answer nothing
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        _, monitor = make_sim()
        bso = BatchSizeOptimizer(monitor, f"http://127.0.0.1:{port}", JOB, timeout_s=0.2, retries=1,
                                 backoff_s=0.0, power_limit=False)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"failed 2 time\(s\); last: timed out after 0.2 s"):
            bso.get_batch_size()
        assert time.monotonic() - t0 < 3.0
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        listener.close()


def test_an_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, monitor = make_sim()
    bso = BatchSizeOptimizer(monitor, f"http://127.0.0.1:{port}/", JOB, retries=1, backoff_s=0.0,
                             power_limit=False)
    with pytest.raises(ServerError, match=rf"could not register the job: POST http://127.0.0.1:{port}/jobs "
                                          r"failed 2 time\(s\); last: ConnectError"):
        bso.get_batch_size()


@pytest.mark.parametrize("url", ["bso.test:7787", "localhost", "ftp://bso.test", "http://", "http://h:notaport",
                                 "http://h:1/?x=1"])
def test_a_malformed_server_url_is_rejected_at_once(url: str):
    _, monitor = make_sim()
    with pytest.raises(JoulesError, match="server_url"):
        BatchSizeOptimizer(monitor, url, JOB)


def test_409_says_which_fields_differ():
    server = FakeServer()
    _, monitor = make_sim()
    make_client(monitor, server)[0].get_batch_size()
    changed = {**JOB, "target_metric": 0.95, "max_epochs": 10}
    bso, sleeps = make_client(monitor, server, job=changed)
    with pytest.raises(ServerError) as info:
        bso.get_batch_size()
    assert str(info.value) == (
        f"could not register the job 'resnet/cifar10' at {URL}: job 'resnet/cifar10' is already registered "
        "with another spec (differs in: target_metric, max_epochs); register under a new name (a job of that "
        "name is registered with a different spec: use its spec, or another name)")
    assert info.value.status_code == 409 and sleeps == []
    # The same spec, written differently (batch sizes in another order), is the same job.
    same = {**JOB, "batch_sizes": [32, 64, 128, 256]}
    assert make_client(monitor, server, job=same)[0].get_batch_size() == 64
    assert len(server.jobs) == 1


def test_token_header_from_argument_or_environment(monkeypatch):
    server = FakeServer(token="s3cret")
    _, monitor = make_sim()
    monkeypatch.delenv("JOULES_SERVER_TOKEN", raising=False)
    bso, sleeps = make_client(monitor, server)
    with pytest.raises(ServerError, match=r"HTTP 401 \(check the token: token=\.\.\. or \$JOULES_SERVER_TOK"):
        bso.get_batch_size()
    assert "authorization" not in server.requests[0].headers and sleeps == []

    assert make_client(monitor, server, token="s3cret")[0].get_batch_size() == 64
    monkeypatch.setenv("JOULES_SERVER_TOKEN", "s3cret")
    assert make_client(monitor, server)[0].get_batch_size() == 64
    assert all(r.headers["authorization"] == "Bearer s3cret" for r in server.requests[1:])
    with pytest.raises(ValueError, match=r"\$JOULES_SERVER_TOKEN\) has characters other than printable"):
        make_client(monitor, server, token="sécret")


def test_retry_waits_double_up_to_30_s_however_many_retries():
    server = FakeServer()
    server.failures = [503] * 12
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, backoff_s=0.5, retries=12)
    assert bso.get_batch_size() == 64
    assert len(sleeps) == 12
    assert 0.5 <= sleeps[0] <= 0.55 and 16.0 <= sleeps[5] <= 17.6
    assert all(30.0 <= s <= 33.0 for s in sleeps[6:]), sleeps
    assert 30.0 <= bso._delay(5000, None) <= 33.0  # no overflow however far the count goes


@pytest.mark.parametrize(("error", "status"), [
    (RuntimeError("boom: a bug in the training script"), "aborted"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "failed"),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA error"), "failed"),  # torch's class
    (MemoryError(), "failed"),
])
def test_an_exception_in_training_ends_the_trial_and_restores_limits(error: BaseException, status: str):
    """A crash says nothing about the batch size (aborted: handed out again); running out of
    memory does (failed: it was aborted, and handed out again in every recurrence)."""
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server)
    with pytest.raises(type(error)), bso:
        bso.get_batch_size()
        bso.on_train_begin()
        for _ in range(3):
            bso.on_step_begin()
            sim.run(WORK_S, CF)
            bso.on_step_end()
        assert sim.gpus[0].power_limit_w() == 400.0  # the first candidate is the highest limit
        raise error
    assert server.bodies("POST", "/end") == [{"status": status}]
    assert server.trials["t1"]["outcome"] == status
    assert monitor.open_windows == [] and sim.gpus[0].power_limit_w() == 400.0


def test_a_metric_that_is_not_finite_fails_the_trial():
    """A NaN metric (training diverged) raised ValueError before the report, so the trial was
    aborted and the batch size handed out again; caught, its epoch merged into the next one's."""
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server)
    bso.get_batch_size()
    bso.on_train_begin()
    sim.run(WORK_S, CF)
    assert bso.on_evaluate(math.nan) is True
    assert server.bodies("POST", "/end") == [{"status": "failed"}]
    assert server.trials["t1"]["outcome"] == "failed"
    assert monitor.open_windows == []
    with pytest.raises(JoulesError, match="after the trial ended"):
        bso.on_evaluate(0.5)
    bso.on_train_end()  # nothing more to do
    assert len(server.bodies("POST", "/end")) == 1


def test_with_block_ends_the_trial_completed_and_a_new_trial_needs_get_batch_size():
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    with bso:
        bso.get_batch_size()
        bso.on_step_begin()  # begins training implicitly
        sim.run(WORK_S, CF)
        bso.on_step_end()
        bso.on_evaluate(0.95)
    assert server.bodies("POST", "/end") == [{"status": "completed"}]
    with pytest.raises(JoulesError, match=r"call get_batch_size\(\) first"):
        bso.on_step_begin()
    with pytest.raises(JoulesError, match=r"on_evaluate\(\) after the trial ended"):
        bso.on_evaluate(0.9)
    assert bso.get_batch_size() == 64  # the next trial
    assert len(server.trials) == 2 and len(server.jobs) == 1
    assert bso.epoch == 0


def test_abort_that_cannot_reach_the_server_does_not_hide_the_training_error(caplog):
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, retries=0, power_limit=False)
    bso.get_batch_size()
    bso.on_train_begin()
    server.failures = ["connect"]
    with caplog.at_level(logging.WARNING, "joules.batch_size"), pytest.raises(KeyError), bso:
        raise KeyError("boom")
    assert "could not mark the trial aborted" in caplog.text


def test_power_limit_without_permission_warns_by_default_and_raises_when_asked(caplog):
    server = FakeServer()
    sim, monitor = make_sim(allow_control=False)
    bso, _ = make_client(monitor, server, power_limit=True)
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        train(bso, sim, [0.95])
    assert "power-limit optimizer is off" in caplog.text and bso.power_limit_optimizer is None
    assert server.trials["t1"]["outcome"] == "reached"

    bso, _ = make_client(monitor, server, power_limit={"handle_signals": False})
    bso.get_batch_size()
    with pytest.raises(joules.DevicePermissionError, match="SYS_ADMIN"):
        bso.on_train_begin()
    assert server.trials["t2"]["outcome"] == "aborted"
    assert monitor.open_windows == []


def test_power_limit_arguments_are_checked_and_a_monitor_without_gpus_only_warns(caplog):
    _, monitor = make_sim()
    with pytest.raises(ValueError, match=r"unknown PowerLimitOptimizer argument\(s\) \['warmup_step'\]"):
        BatchSizeOptimizer(monitor, URL, JOB, power_limit={"warmup_step": 2})
    server = FakeServer()
    sim, cpu_only = make_sim("XEON8480")
    bso, _ = make_client(cpu_only, server, power_limit=True)
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        train(bso, sim, [0.95])
    assert "the monitor measures no GPU" in caplog.text
    assert server.bodies("POST", "/epochs")[0]["energy_j"] == 0.0


def test_power_limit_false_and_default_max_power():
    server = FakeServer()
    sim, monitor = make_sim("A100x2")
    job = {k: v for k, v in JOB.items() if k != "max_power_w"}
    bso, _ = make_client(monitor, server, job=job, power_limit=False)
    assert bso.spec.max_power_w == 800.0  # two A100s at 400 W
    train(bso, sim, [0.95])
    assert bso.power_limit_optimizer is None


@pytest.mark.parametrize("backoff", [-1.0, math.nan])
def test_a_bad_backoff_is_refused(backoff: float):
    _, monitor = make_sim()
    with pytest.raises(ValueError, match="backoff_s must be >= 0"):
        BatchSizeOptimizer(monitor, URL, JOB, backoff_s=backoff)


def test_a_bad_job_spec_names_the_field():
    _, monitor = make_sim()
    with pytest.raises(ValueError, match="default_batch_size 48 is not one of batch_sizes"):
        BatchSizeOptimizer(monitor, URL, {**JOB, "default_batch_size": 48})


@pytest.mark.parametrize(("metric", "error", "match"), [
    ("0.9", TypeError, r"metric must be a number, got str '0\.9'"),
    (None, TypeError, r"metric must be a number, got NoneType None"),
    (True, TypeError, r"metric must be a number, got bool True"),
])
def test_a_metric_that_is_not_a_number_is_refused_naming_it(metric: Any, error: type, match: str):
    server, sim, bso = started_trial()
    sim.run(5.0, CF)
    with pytest.raises(error, match=match):
        bso.on_evaluate(metric)
    assert server.bodies("POST", "/epochs") == []  # nothing reported
    assert bso.on_evaluate(0.5) is False  # the epoch can still be reported
    bso.on_train_end()


def test_on_evaluate_after_stop_says_stop_again_without_reporting(caplog):
    server, sim, bso = started_trial()
    sim.run(5.0, CF)
    assert bso.on_evaluate(0.95) is True
    sim.run(5.0, CF)
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        assert bso.on_evaluate(0.97) is True
    assert "after the server said to stop (reached)" in caplog.text
    assert len(server.bodies("POST", "/epochs")) == 1
    bso.on_train_end()
    assert bso.trial is not None and bso.trial.outcome == "reached"


def test_training_that_ends_without_a_stop_answer_is_completed():
    server = FakeServer()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    train(bso, sim, [0.1, 0.2])  # the loop ends before the target or max_epochs
    assert server.bodies("POST", "/end") == [{"status": "completed"}]
    assert bso.trial is not None and bso.trial.outcome == "max_epochs" and bso.stop_reason is None


def test_a_trial_whose_answer_was_lost_is_not_created_twice():
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server)
    bso.get_batch_size()  # registered
    bso.abort()
    server.failures = ["lost"]  # the server creates the trial, its answer never arrives
    bso.get_batch_size()
    assert len(server.trials) == 2  # one aborted, one in use: the retry got the same trial back
    creates = server.bodies("POST", "/trials")
    assert len(creates) == 3 and creates[1]["request_id"] == creates[2]["request_id"]
    assert creates[0]["request_id"] != creates[1]["request_id"]
    assert bso.trial is not None and bso.trial.trial_id == "t2"




@pytest.mark.parametrize("failure", ["lost", "connect"])
def test_an_epoch_report_that_failed_is_sent_again_unchanged_before_the_next(failure: str):
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    server.failures = [failure] * 6  # every attempt fails ("lost": the server did take epoch 1)
    with pytest.raises(ServerError, match="could not report epoch 1"):
        bso.on_evaluate(0.5)
    assert bso.epoch == 0
    sim.run(2.0, CF)  # the caller carries on training: the next epoch
    assert bso.on_evaluate(0.6) is False
    epochs = server.bodies("POST", "/epochs")
    assert epochs[:6] == [epochs[0]] * 6 and epochs[6] == epochs[0]  # epoch 1 sent again, unchanged
    assert [e["epoch"] for e in epochs[6:]] == [1, 2] and epochs[7]["metric"] == 0.6
    assert epochs[0]["time_s"] == pytest.approx(1.0) and epochs[7]["time_s"] == pytest.approx(2.0)
    assert [r.report.epoch for r in bso.epochs] == [1, 2]
    assert server.trials["t1"]["epochs"] == 2
    assert server.trials["t1"]["time_s"] == pytest.approx(3.0)  # no epoch's time is lost
    bso.on_train_end()
    assert server.trials["t1"]["outcome"] == "max_epochs"


def test_an_epoch_report_that_failed_is_sent_before_the_end():
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    server.failures = ["connect"] * 6
    with pytest.raises(ServerError):
        bso.on_evaluate(0.5)
    bso.on_train_end()
    assert [e["epoch"] for e in server.bodies("POST", "/epochs")[6:]] == [1]
    assert server.trials["t1"]["epochs"] == 1 and server.trials["t1"]["time_s"] == pytest.approx(1.0)
    assert server.trials["t1"]["outcome"] == "max_epochs"  # not aborted: it had an epoch


def test_a_refused_epoch_report_is_kept_and_sent_again_unchanged():
    # A proxy's 403 (not retried): the epoch's time and energy are not lost, and the next
    # epoch does not take its number.
    server, sim, bso = started_trial()
    sim.run(2.0, CF)
    assert bso.on_evaluate(0.1) is False
    sim.run(2.0, CF)
    server.failures = [403]
    with pytest.raises(ServerError, match="HTTP 403"):
        bso.on_evaluate(0.2)
    sim.run(2.0, CF)
    assert bso.on_evaluate(0.3) is False
    sent = server.bodies("POST", "/epochs")
    assert [e["epoch"] for e in sent] == [1, 2, 2, 3] and sent[1] == sent[2]
    trial = server.trials["t1"]
    assert trial["epochs"] == 3 and trial["time_s"] == pytest.approx(6.0)
    assert bso.epoch == 3


def test_a_request_timeout_from_a_proxy_is_retried():
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    server.failures = [408]
    assert bso.on_evaluate(0.1) is False
    assert [e["epoch"] for e in server.bodies("POST", "/epochs")] == [1, 1]
    assert server.trials["t1"]["epochs"] == 1


def test_when_the_resent_report_says_stop_the_next_epoch_is_not_reported(caplog):
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    server.failures = ["lost"] * 6  # the server took epoch 1 and said stop (reached)
    with pytest.raises(ServerError):
        bso.on_evaluate(0.95)
    sim.run(1.0, CF)
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        assert bso.on_evaluate(0.97) is True
    assert "the server said to stop after epoch 1" in caplog.text
    assert [e["epoch"] for e in server.bodies("POST", "/epochs")] == [1] * 7  # no 409, no epoch 2
    assert bso.stop_reason == "reached" and bso.epoch == 1
    bso.on_train_end()
    assert bso.trial is not None and bso.trial.outcome == "reached"


def test_an_end_that_failed_is_sent_again_by_the_next_end():
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    bso.on_evaluate(0.5)
    server.failures = ["connect"] * 6  # the server restarts for a while
    with pytest.raises(ServerError, match=r"could not end the trial \(completed\)"):
        bso.on_train_end()
    assert server.trials["t1"]["status"] == "running"
    bso.abort()  # e.g. the with block's exit, after the error: the same request again
    assert server.bodies("POST", "/end") == [{"status": "completed"}] * 7
    assert server.trials["t1"]["outcome"] == "max_epochs"
    assert bso.trial is not None and bso.trial.status == "ended"
    n = len(server.requests)
    bso.on_train_end()
    bso.abort()
    assert len(server.requests) == n  # ended: nothing more to send


def test_a_new_trial_first_ends_the_one_whose_end_failed():
    server, sim, bso = started_trial()
    sim.run(1.0, CF)
    server.failures = ["connect"] * 6
    with pytest.raises(ServerError):
        bso.abort()
    assert bso.get_batch_size() == 64
    assert server.trials["t1"]["outcome"] == "aborted" and server.trials["t2"]["status"] == "running"
    assert bso.trial is not None and bso.trial.trial_id == "t2"


def test_an_end_the_server_refuses_is_not_sent_again():
    server, sim, bso = started_trial()
    server.failures = [404]
    with pytest.raises(ServerError, match="HTTP 404"):
        bso.on_train_end()
    n = len(server.requests)
    bso.on_train_end()
    assert len(server.requests) == n


def test_a_trial_made_for_a_create_whose_every_answer_was_lost_is_handed_back_next_time():
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    server.failures = [None] + ["lost"] * 6  # registered; every answer to the create is lost
    with pytest.raises(ServerError, match="could not create a trial: .* failed 6 time"):
        bso.get_batch_size()
    assert list(server.trials) == ["t1"] and server.trials["t1"]["status"] == "running"
    assert bso.get_batch_size() == 64
    assert list(server.trials) == ["t1"]  # not a second trial running beside the first
    assert bso.trial is not None and bso.trial.trial_id == "t1"
    creates = server.bodies("POST", "/trials")
    assert len(creates) == 7 and all(c["request_id"] == creates[0]["request_id"] for c in creates)
    bso.abort()
    bso.get_batch_size()  # a new trial: a new request id
    assert server.bodies("POST", "/trials")[-1]["request_id"] != creates[0]["request_id"]
    assert bso.trial is not None and bso.trial.trial_id == "t2"


def test_a_create_that_never_reached_the_server_is_sent_again_with_the_same_request_id():
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False, retries=1)
    server.failures = [None, "connect", 503]
    with pytest.raises(ServerError, match="HTTP 503"):
        bso.get_batch_size()
    assert server.trials == {}
    bso.get_batch_size()
    creates = server.bodies("POST", "/trials")
    assert len(creates) == 3 and creates[0] == creates[1] == creates[2]
    assert list(server.trials) == ["t1"] and bso.trial is not None and bso.trial.trial_id == "t1"


def test_a_create_the_server_refuses_is_not_sent_again_with_the_same_request_id():
    server = FakeServer()
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, power_limit=False)
    server.failures = [None, 400]
    with pytest.raises(ServerError, match="HTTP 400"):
        bso.get_batch_size()
    assert sleeps == []
    bso.get_batch_size()
    first, second = server.bodies("POST", "/trials")
    assert first["request_id"] != second["request_id"]


def test_a_handed_back_trial_that_has_ended_since_is_replaced(caplog):
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False, retries=0)
    server.failures = [None, "lost"]
    with pytest.raises(ServerError):
        bso.get_batch_size()
    server.trials["t1"].update(status="ended", outcome="aborted")  # it expired meanwhile
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        assert bso.get_batch_size() == 64
    assert "trial t1, made for a request whose answer was lost, has ended since" in caplog.text
    assert bso.trial is not None and bso.trial.trial_id == "t2" and bso.trial.status == "running"
    first, again, new = server.bodies("POST", "/trials")
    assert first == again and new["request_id"] != first["request_id"]


def test_abort_after_a_lost_create_ends_the_trial_the_server_made():
    server = FakeServer()
    _, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    server.failures = [None] + ["lost"] * 6
    with pytest.raises(ServerError, match="could not create a trial"), bso:
        bso.get_batch_size()  # the with block's exit aborts
    creates = server.bodies("POST", "/trials")
    assert len(creates) == 7 and creates[6] == creates[0]  # one more attempt, the same request id
    assert server.bodies("POST", "/end") == [{"status": "aborted"}]
    assert server.trials["t1"]["outcome"] == "aborted" and len(server.trials) == 1
    assert bso.trial is not None and bso.trial.trial_id == "t1" and bso.trial.status == "ended"
    n = len(server.requests)
    bso.abort()
    assert len(server.requests) == n  # nothing more to end
    bso.get_batch_size()
    assert server.bodies("POST", "/trials")[-1]["request_id"] != creates[0]["request_id"]
    assert bso.trial.trial_id == "t2"


def test_abort_after_a_lost_create_tries_once_and_keeps_the_request_id(caplog):
    server = FakeServer()
    _, monitor = make_sim()
    bso, sleeps = make_client(monitor, server, power_limit=False, retries=2)
    server.failures = [None] + ["lost"] * 3 + ["connect"]  # then the server is unreachable
    with pytest.raises(ServerError):
        bso.get_batch_size()
    n_sleeps = len(sleeps)
    with caplog.at_level(logging.WARNING, "joules.batch_size"):
        bso.abort()  # no exception: nothing was handed to the caller
    assert "could not learn the trial of the failed creation" in caplog.text
    assert len(sleeps) == n_sleeps  # one attempt, no backoff
    assert len(server.bodies("POST", "/trials")) == 4 and server.bodies("POST", "/end") == []
    assert bso.trial is None
    assert bso.get_batch_size() == 64  # the same request id: the trial the server made
    assert list(server.trials) == ["t1"] and bso.trial is not None and bso.trial.trial_id == "t1"
    creates = server.bodies("POST", "/trials")
    assert all(c == creates[0] for c in creates)


def test_a_programs_own_sigterm_handler_is_kept_after_a_trial_with_the_power_limit_search():
    """The client's handler, put back by the power-limit search's restore guard after the client
    had taken its own out, stayed installed holding nothing: the program's handler (a graceful
    shutdown) was never called again, and SIGTERM killed the process."""
    import signal

    from joules.optimizers.batch_size import client as client_module

    got: list[int] = []
    client_module._PREVIOUS.clear()  # (as in a fresh process: the client's handler goes over the program's)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        server = FakeServer()
        sim, monitor = make_sim()
        bso, _ = make_client(monitor, server, power_limit={**FAST_PL, "handle_signals": True})
        with bso:
            bso.get_batch_size()
            assert signal.getsignal(signal.SIGTERM) is client_module._on_end_signal
            bso.on_train_begin()
            for _ in range(3):
                bso.on_step_begin()
                sim.run(WORK_S, CF)
                bso.on_step_end()
            signal.raise_signal(signal.SIGTERM)  # while training: the program's handler decides
            assert got == [signal.SIGTERM] and server.trials["t1"]["status"] == "running"
            assert bso.on_evaluate(0.95) is True
        signal.raise_signal(signal.SIGTERM)  # after the trial: still the program's handler
        assert got == [signal.SIGTERM, signal.SIGTERM]
        assert server.trials["t1"]["outcome"] != "aborted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        client_module._PREVIOUS.pop(signal.SIGTERM, None)


class ServerBeforeFailed(FakeServer):
    """A server of a joules before trials could fail: ``{"status": "failed"}`` is a 422."""

    def handle(self, request: httpx.Request) -> httpx.Response:
        status = json.loads(request.content or b"{}").get("status")
        if request.url.path.endswith("/end") and status == "failed":
            detail = "body.status: Input should be 'completed' or 'aborted'"
            return httpx.Response(422, json={"detail": detail})
        return super().handle(request)


def test_a_server_that_does_not_know_failed_trials_gets_them_aborted():
    """Such a server refused the end: the trial stayed running for a day, and a NaN metric
    made on_evaluate raise instead of saying stop."""
    server = ServerBeforeFailed()
    sim, monitor = make_sim()
    bso, _ = make_client(monitor, server, power_limit=False)
    bso.get_batch_size()
    bso.on_train_begin()
    sim.run(WORK_S, CF)
    assert bso.on_evaluate(math.inf) is True
    assert server.bodies("POST", "/end") == [{"status": "failed"}, {"status": "aborted"}]
    assert server.trials["t1"]["outcome"] == "aborted"
    with pytest.raises(RuntimeError), bso:  # running out of memory, the same
        bso.get_batch_size()
        bso.on_train_begin()
        raise RuntimeError("CUDA out of memory")
    assert server.trials["t2"]["outcome"] == "aborted"


def test_ending_the_trials_at_a_signal_takes_two_seconds_at_most(monkeypatch: pytest.MonkeyPatch):
    """A server that accepts and never answers (or trickles a byte a second) delayed the
    process's end by the timeout per client and per read: 40 s in one case."""
    import signal
    import time

    from joules.optimizers.batch_size import client as client_module

    server = FakeServer()
    sim, monitor = make_sim()
    clients = []
    for _ in range(3):
        bso, _ = make_client(monitor, server, power_limit=False)
        bso.get_batch_size()
        bso.on_train_begin()
        clients.append(bso)
    stuck: list[str] = []
    monkeypatch.setattr(client_module.BatchSizeOptimizer, "_end_at_exit",
                        lambda self, errors: (stuck.append(self.trial.trial_id), time.sleep(10)))
    t0 = time.monotonic()
    client_module._end_trials(signal.SIGTERM, clients)
    assert time.monotonic() - t0 < 3.0 and len(stuck) == 3  # given up on after 2 s, all together
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the handlers ignored meanwhile are back
    for bso in clients:
        bso.abort()


def test_a_second_signal_while_the_programs_handler_runs_goes_to_it_again():
    """A second SIGTERM while the program's own handler saved a checkpoint was taken for that
    handler passing the signal back: the trials were ended and the process killed mid-save."""
    import signal

    calls: list[int] = []

    def saving(signum, frame):  # type: ignore[no-untyped-def]
        calls.append(signum)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)  # a second one comes while it saves

    from joules.optimizers.batch_size import client as client_module

    client_module._PREVIOUS.clear()  # (as in a fresh process: the client's handler goes over the program's)
    previous = signal.signal(signal.SIGTERM, saving)
    try:
        server = FakeServer()
        sim, monitor = make_sim()
        bso, _ = make_client(monitor, server, power_limit=False)
        with bso:
            bso.get_batch_size()
            bso.on_train_begin()
            assert signal.getsignal(signal.SIGTERM) is client_module._on_end_signal
            signal.raise_signal(signal.SIGTERM)
            assert calls == [signal.SIGTERM, signal.SIGTERM]  # the program's handler, twice: alive
            assert server.trials["t1"]["status"] == "running"
            sim.run(WORK_S, CF)
            assert bso.on_evaluate(0.95) is True
        assert server.trials["t1"]["outcome"] == "reached"
    finally:
        signal.signal(signal.SIGTERM, previous)
        client_module._PREVIOUS.pop(signal.SIGTERM, None)
