"""The batch-size server's API over real HTTP (``joules serve --workers 2``), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from bso_helpers import Served, check_policy_consistent, db_view, metric_value, register, spec

from joules.optimizers.batch_size.types import trial_cost
from joules.servers.batch_size.schemas import EpochAnswer, JobOut, JobState, TrialOut
from joules.testing.bso_server import ServerProcess


def report(c: httpx.Client, job: str, trial: str, epoch: int, time_s: float = 10.0, energy_j: float = 2000.0,
           metric: float = 0.1) -> httpx.Response:
    return c.post(f"/jobs/{job}/trials/{trial}/epochs",
                  json={"epoch": epoch, "time_s": time_s, "energy_j": energy_j, "metric": metric})


def test_register_trial_report_end_state_history(bso_server: Served) -> None:
    body = spec(max_epochs=4)
    with bso_server.client() as c:
        r = c.post("/jobs", json=body)
        assert r.status_code == 201
        job = JobOut.model_validate(r.json())
        assert job.name == body["name"] and job.batch_sizes == [32, 64, 128, 256]
        again = c.post("/jobs", json={**body, "batch_sizes": [256, 128, 64, 32]})  # same spec, other order
        assert again.status_code == 200 and again.json()["job_id"] == job.job_id

        # Trial 1: the counting policy explores 32 first; it reaches the target at epoch 3.
        t1 = TrialOut.model_validate(c.post(f"/jobs/{job.job_id}/trials", json={"client": "host-a"}).json())
        assert (t1.batch_size, t1.phase, t1.status, t1.stop_cost) == (32, "explore", "running", None)
        answers = [EpochAnswer.model_validate(report(c, job.job_id, t1.trial_id, e, metric=m).json())
                   for e, m in ((1, 0.5), (2, 0.8), (3, 0.95))]
        assert [a.stop for a in answers] == [False, False, True] and answers[2].reason == "reached"
        assert answers[2].cost == trial_cost(0.5, 300.0, 6000.0, 30.0)
        end = c.post(f"/jobs/{job.job_id}/trials/{t1.trial_id}/end", json={})
        ended = TrialOut.model_validate(end.json())
        assert (ended.status, ended.outcome, ended.epochs, ended.time_s, ended.energy_j) == (
            "ended", "reached", 3, 30.0, 6000.0)
        assert ended.ended_at is not None and ended.ended_at >= ended.created_at

        # Trial 2 (64) now has a stop cost, 2 x trial 1's; it runs out of epochs.
        t2 = TrialOut.model_validate(c.post(f"/jobs/{job.job_id}/trials").json())  # no body at all
        assert t2.batch_size == 64 and t2.stop_cost == pytest.approx(2 * ended.cost)
        for e in range(1, 5):
            r = report(c, job.job_id, t2.trial_id, e, time_s=1.0, energy_j=10.0)
            a = EpochAnswer.model_validate(r.json())
        assert a.stop and a.reason == "max_epochs" and a.stop_cost == pytest.approx(2 * ended.cost)

        # Trial 3 (128) costs too much: stopped early after its second epoch, before a third like
        # it would cross the stop cost (15000): 5250 + 5250 would not, 5250 + 8250 + 8250 would.
        t3 = c.post(f"/jobs/{job.job_id}/trials").json()
        assert not report(c, job.job_id, t3["trial_id"], 1, time_s=30.0, energy_j=1500.0).json()["stop"]
        a = report(c, job.job_id, t3["trial_id"], 2, time_s=45.0, energy_j=3000.0).json()
        assert (a["stop"], a["reason"]) == (True, "early_stopped") and a["cost"] == 5250.0 + 8250.0

        # Trial 4 (256) is aborted; trial 5 (exploit) ends "completed" without being told to stop.
        t4 = c.post(f"/jobs/{job.job_id}/trials").json()
        report(c, job.job_id, t4["trial_id"], 1)
        assert c.post(f"/jobs/{job.job_id}/trials/{t4['trial_id']}/end",
                      json={"status": "aborted"}).json()["outcome"] == "aborted"
        t5 = c.post(f"/jobs/{job.job_id}/trials").json()
        assert (t5["batch_size"], t5["phase"]) == (32, "exploit")
        report(c, job.job_id, t5["trial_id"], 1)
        done = c.post(f"/jobs/{job.job_id}/trials/{t5['trial_id']}/end", json={"status": "completed"}).json()
        assert done["outcome"] == "max_epochs"  # ended without reaching the target
        # Ending again changes nothing; a trial with no report ends as aborted.
        assert c.post(f"/jobs/{job.job_id}/trials/{t5['trial_id']}/end",
                      json={"status": "aborted"}).json() == done
        t6 = c.post(f"/jobs/{job.job_id}/trials").json()
        assert c.post(f"/jobs/{job.job_id}/trials/{t6['trial_id']}/end").json()["outcome"] == "aborted"

        state = JobState.model_validate(c.get(f"/jobs/{job.job_id}").json())
        assert state.job == job
        assert state.trials == {"running": 0, "ended": 6, "reached": 1, "max_epochs": 2, "early_stopped": 1,
                                "aborted": 2}
        assert state.explored == {32: "ok", 64: "failed", 128: "failed", 256: "pending"}
        assert state.best_batch_size == 32 and state.best_cost == pytest.approx(ended.cost)
        assert state.posterior[32].n == 1

        history = [TrialOut.model_validate(t) for t in c.get(f"/jobs/{job.job_id}/trials").json()]
        assert [t.trial_id for t in history] == [t1.trial_id, t2.trial_id, t3["trial_id"], t4["trial_id"],
                                                 t5["trial_id"], t6["trial_id"]]
        assert c.get(f"/jobs/{job.job_id}/trials/{t2.trial_id}").json() == history[1].model_dump(mode="json")
    check_policy_consistent(db_view(bso_server.db, job.job_id))


def test_joules_policy_runs_a_job(bso_server: Served) -> None:
    body = spec(counting=False, default_batch_size=64)
    with bso_server.client() as c:
        job = register(c, body)
        sizes = []
        for _ in range(6):
            t = c.post(f"/jobs/{job}/trials").json()
            sizes.append(t["batch_size"])
            epochs_to_target = {32: 4, 64: 2, 128: 3, 256: 7}[t["batch_size"]]
            for e in range(1, body["max_epochs"] + 1):
                a = report(c, job, t["trial_id"], e, metric=0.95 if e >= epochs_to_target else 0.5).json()
                if a["stop"]:
                    break
            c.post(f"/jobs/{job}/trials/{t['trial_id']}/end")
        state = c.get(f"/jobs/{job}").json()
    # Exploration starts at the default, which reached the target in 2 of 6 epochs (a third):
    # the job's max_epochs reaches the policy, which explores upwards first, and to the end.
    assert sizes[:3] == [64, 128, 256]
    assert state["best_batch_size"] == 64 and state["trials"]["ended"] == 6
    assert set(state["explored"]) <= {"32", "64", "128", "256"}
    view = db_view(bso_server.db, job)
    assert view.state["variant"] == "joules" and len(view.state["history"]) == 6
    check_policy_consistent(view)


def test_a_batch_size_that_cannot_train_is_ended_failed_and_not_handed_out_again(bso_server: Served) -> None:
    """A batch size that runs out of memory before its first epoch could only be aborted (a
    trial without epochs always was), and came back in every recurrence."""
    body = spec(counting=False, default_batch_size=64)
    with bso_server.client() as c:
        job = register(c, body)
        sizes = []
        for _ in range(8):
            t = c.post(f"/jobs/{job}/trials").json()
            sizes.append(t["batch_size"])
            if t["batch_size"] == 256:  # out of memory at once
                end = c.post(f"/jobs/{job}/trials/{t['trial_id']}/end", json={"status": "failed"}).json()
                assert (end["outcome"], end["epochs"]) == ("failed", 0)
                continue
            for e in range(1, body["max_epochs"] + 1):
                a = report(c, job, t["trial_id"], e, metric=0.95 if e >= 2 else 0.5).json()
                if a["stop"]:
                    break
            c.post(f"/jobs/{job}/trials/{t['trial_id']}/end")
        state = c.get(f"/jobs/{job}").json()
    assert sizes.count(256) == 1 and state["explored"]["256"] == "failed"
    assert state["trials"]["failed"] == 1 and 256 not in state["surviving"]
    check_policy_consistent(db_view(bso_server.db, job))


def test_epoch_reports_are_idempotent_and_checked(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec(max_epochs=3))
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        first = report(c, job, trial, 1, metric=0.2)
        assert first.status_code == 200
        again = report(c, job, trial, 1, metric=0.2)  # a client's retry
        assert again.status_code == 200 and again.json() == first.json()
        other = report(c, job, trial, 1, metric=0.3)
        assert other.status_code == 409
        assert "epoch 1" in other.json()["detail"] and "metric=0.2" in other.json()["detail"]
        gap = report(c, job, trial, 3)
        assert gap.status_code == 409 and "next epoch is 2" in gap.json()["detail"]
        last = report(c, job, trial, 2, metric=0.99)
        assert last.json()["reason"] == "reached"
        assert report(c, job, trial, 2, metric=0.99).json() == last.json()  # retry after the trial ended
        late = report(c, job, trial, 3)
        assert late.status_code == 409 and "has ended" in late.json()["detail"]
        t = c.get(f"/jobs/{job}/trials/{trial}").json()
        assert (t["epochs"], t["time_s"], t["energy_j"]) == (2, 20.0, 4000.0)  # nothing counted twice


def test_lower_is_better_metric(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec(target_metric=0.25, higher_is_better=False))
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        assert not report(c, job, trial, 1, metric=0.3).json()["stop"]
        assert report(c, job, trial, 2, metric=0.25).json()["reason"] == "reached"


def test_conflicting_registration(bso_server: Served) -> None:
    body = spec()
    with bso_server.client() as c:
        register(c, body)
        r = c.post("/jobs", json={**body, "max_epochs": 9, "knobs": {"lr": 0.1}})
        assert r.status_code == 409
        assert body["name"] in r.json()["detail"] and "max_epochs" in r.json()["detail"]
        assert "knobs" in r.json()["detail"]


def test_unknown_job_and_trial_are_404_naming_them(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec())
        other = register(c, spec())
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        for method, path in (("GET", "/jobs/nope"), ("GET", "/jobs/nope/trials"),
                             ("POST", "/jobs/nope/trials")):
            r = c.request(method, path)
            assert r.status_code == 404 and r.json() == {"detail": "job 'nope' not found"}
        r = report(c, job, "missing", 1)
        assert r.status_code == 404 and "'missing'" in r.json()["detail"] and job in r.json()["detail"]
        r = report(c, other, trial, 1)  # a trial of another job
        assert r.status_code == 404 and trial in r.json()["detail"]
        for r in (report(c, "nope", trial, 1), c.post(f"/jobs/nope/trials/{trial}/end")):
            assert r.status_code == 404 and r.json() == {"detail": "job 'nope' not found"}
        assert c.get(f"/jobs/{job}/trials/zzz").status_code == 404


@pytest.mark.parametrize(("body", "fields"), [
    ({}, {"name", "batch_sizes", "default_batch_size", "target_metric", "max_epochs", "max_power_w"}),
    ({"batch_sizes": [32, 32]}, {"batch_sizes"}),
    ({"batch_sizes": [0, 32]}, {"batch_sizes"}),
    ({"batch_sizes": []}, {"batch_sizes"}),
    ({"default_batch_size": 48}, {"default_batch_size"}),  # not one of batch_sizes
    ({"name": "bad name!"}, {"name"}),
    ({"eta": 1.5, "beta": 1.0}, {"eta", "beta"}),
    ({"max_epochs": 0, "max_power_w": -1}, {"max_epochs", "max_power_w"}),
    ({"target_metric": "high"}, {"target_metric"}),
    ({"policy": "zeus"}, {"policy"}),
    ({"unknown": 1}, {"unknown"}),
    ({"seed": -1}, {"seed"}),
    ({"seed": True, "max_epochs": True}, {"seed", "max_epochs"}),  # JSON true is no integer
    ({"target_metric": True, "max_power_w": True, "eta": False, "stale_after_s": True},
     {"target_metric", "max_power_w", "eta", "stale_after_s"}),  # nor a number
    ({"knobs": {"lr": "x" * 1001}}, {"knobs"}),
    ({"knobs": {"k" * 1001: 1}}, {"knobs"}),
])
def test_bad_job_is_422_naming_fields(bso_server: Served, body: dict, fields: set[str]) -> None:
    full = {} if body == {} else {**spec(), **body}
    with bso_server.client() as c:
        r = c.post("/jobs", json=full)
    assert r.status_code == 422, r.text
    locs = {str(part) for d in r.json()["detail"] for part in d["loc"]}
    assert fields <= locs, r.json()


@pytest.mark.parametrize(("body", "fields"), [
    ({"epoch": 0, "time_s": 1, "energy_j": 1, "metric": 0}, {"epoch"}),
    ({"epoch": 1, "time_s": -1, "energy_j": 1, "metric": 0}, {"time_s"}),
    ({"epoch": 1, "time_s": 1, "energy_j": -0.5, "metric": 0}, {"energy_j"}),
    ({"epoch": 1, "time_s": 1, "energy_j": 1}, {"metric"}),
    ({"epoch": 1.5, "time_s": "x", "energy_j": 1, "metric": 0}, {"epoch", "time_s"}),
    ({"epoch": 2_000_000, "time_s": 1, "energy_j": 1, "metric": 0}, {"epoch"}),
    ({"epoch": 1, "time_s": 1, "energy_j": 1, "metric": 0, "loss": 3}, {"loss"}),
    ({"epoch": True, "time_s": 1, "energy_j": 1, "metric": 0}, {"epoch"}),
    ({"epoch": 1, "time_s": True, "energy_j": False, "metric": True}, {"time_s", "energy_j", "metric"}),
])
def test_bad_report_is_422_naming_fields(bso_server: Served, body: dict, fields: set[str]) -> None:
    with bso_server.client() as c:
        job = register(c, spec())
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        r = c.post(f"/jobs/{job}/trials/{trial}/epochs", json=body)
        assert r.status_code == 422, r.text
        assert fields <= {d["loc"][-1] for d in r.json()["detail"]}
        assert c.get(f"/jobs/{job}/trials/{trial}").json()["epochs"] == 0


def test_malformed_bodies_are_422(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec())
        r = c.post("/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
        r = c.post("/jobs", json=[1, 2])
        assert r.status_code == 422
        trial = c.post(f"/jobs/{job}/trials", json={"client": "x" * 201})
        assert trial.status_code == 422 and trial.json()["detail"][0]["loc"] == ["body", "client"]
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        r = c.post(f"/jobs/{job}/trials/{trial}/end", json={"status": "finished"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "status"]
        r = c.get("/jobs/" + "x" * 65)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "job_id"]


def test_inputs_json_text_cannot_echo_are_422_not_500(bso_server: Served) -> None:
    """The 422 echoes the input at fault: a lone surrogate or a body that is not UTF-8 too."""
    json_type = {"Content-Type": "application/json"}
    with bso_server.client() as c:
        job = register(c, spec())
        r = c.post(f"/jobs/{job}/trials", content=b'{"client": "\\ud800"}', headers=json_type)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "client"], r.text
        assert r.json()["detail"][0]["input"] == "\\ud800"
        r = c.post(f"/jobs/{job}/trials", content=b'{"\\udc00": 1}', headers=json_type)
        assert r.status_code == 422, r.text
        r = c.post("/jobs", content=b"\xff\xfe", headers={"Content-Type": "text/plain"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"], r.text
        assert c.get(f"/jobs/{job}").status_code == 200


def test_nul_and_control_characters_are_422_on_every_backend(bso_server: Served) -> None:
    """PostgreSQL's text cannot hold NUL: refused up front with the field named, not a 500."""
    with bso_server.client() as c:
        job = register(c, spec())
        for field in ("client", "request_id"):
            r = c.post(f"/jobs/{job}/trials", json={field: "a\x00b"})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], r.text
        r = c.get("/jobs/abc%00def")
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "job_id"]
        r = c.get(f"/jobs/{job}/trials/abc%01def")
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "trial_id"]
        assert c.post(f"/jobs/{job}/trials", json={"client": "host-1 pid 42"}).status_code == 201


def test_bearer_token(bso_server: Served) -> None:
    with httpx.Client(base_url=bso_server.url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic Zm9vOmJhcg=="}):
            r = c.post("/jobs", json=spec(), headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", headers
            assert "token" in r.json()["detail"]
            assert c.get("/jobs/x", headers=headers).status_code == 401
        assert c.post("/jobs", json=spec(), headers=bso_server.headers).status_code == 201
        assert c.get("/healthz").status_code == 200  # health and metrics stay open
        assert c.get("/metrics").status_code == 200


def test_healthz_and_metrics(bso_server: Served) -> None:
    with bso_server.client() as c:
        health = c.get("/healthz").json()
        assert health == {"status": "ok", "database": bso_server.backend, "revision": "0003"}
        before = c.get("/metrics").text
        job = register(c, spec())
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
        report(c, job, trial, 1)
        report(c, job, trial, 1)
        report(c, job, trial, 2, metric=0.95)
        assert c.get("/openapi.json").status_code == 200 and c.get("/no/such/path").status_code == 404
        # Several calls: the two workers each answer some; /metrics adds them up.
        after = [c.get("/metrics") for _ in range(4)][-1]
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text

    def delta(name: str, labels: str = "") -> float:
        return metric_value(text, name, labels) - metric_value(before, name, labels)

    assert delta("joules_bso_trials_started_total") == 1
    assert delta("joules_bso_epoch_reports_total", 'kind="new"') == 2
    assert delta("joules_bso_epoch_reports_total", 'kind="repeated"') == 1
    assert delta("joules_bso_trials_ended_total", 'outcome="reached"') == 1
    assert delta("joules_bso_requests_total",
                 'method="POST",route="/jobs/{job_id}/trials/{trial_id}/epochs",status="200"') == 3
    assert delta("joules_bso_requests_total", 'method="GET",route="/openapi.json",status="200"') == 1
    assert delta("joules_bso_requests_total", 'method="GET",route="unmatched",status="404"') == 1
    assert "joules_bso_request_duration_seconds_bucket" in text


def test_concurrent_registration_of_one_name_makes_one_job(bso_server: Served) -> None:
    body = spec()
    statuses: list[int] = []
    ids: list[str] = []
    lock = threading.Lock()

    def register_once() -> None:
        with bso_server.client() as c:
            r = c.post("/jobs", json=body)
        with lock:
            statuses.append(r.status_code)
            ids.append(r.json()["job_id"])

    threads = [threading.Thread(target=register_once) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [200] * 11 + [201]
    assert len(set(ids)) == 1


def test_request_id_makes_trial_creation_idempotent(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec())
        first = c.post(f"/jobs/{job}/trials", json={"request_id": "run-1"})
        again = c.post(f"/jobs/{job}/trials", json={"request_id": "run-1", "client": "retry"})
        other = c.post(f"/jobs/{job}/trials", json={"request_id": "run-2"})
        assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
        assert again.json() == first.json() and other.json()["trial_id"] != first.json()["trial_id"]
        assert len(c.get(f"/jobs/{job}/trials").json()) == 2
        assert c.post(f"/jobs/{job}/trials", json={"request_id": ""}).status_code == 422
    view = db_view(bso_server.db, job)
    assert view.state["started"] == 2  # the policy handed out two trials, not three


def test_a_conflicting_spec_names_only_the_fields_that_differ() -> None:
    from joules.servers.batch_size.schemas import JobCreate
    from joules.servers.batch_size.service import _spec_difference

    old = JobCreate.model_validate(spec("j", knobs={"lr": 0.1, "optimizer": "adam"}))
    new = JobCreate.model_validate(spec("j", knobs={"optimizer": "adam", "lr": 0.1}, max_epochs=7))
    assert "(differs in: max_epochs)" in _spec_difference("j", old, new)


def test_a_deeply_nested_body_is_a_422_not_a_500(bso_server: Served) -> None:
    # Valid JSON, nested hundreds deep in a field the schema does not know: echoing it back
    # in the 422's detail must not exhaust the stack.
    body = spec()
    body["extra"] = json.loads("[" * 700 + "]" * 700)
    with bso_server.client() as c:
        r = c.post("/jobs", json=body)
    assert r.status_code == 422, r.text
    assert "..." in r.text


def test_health_and_metrics_answer_while_the_database_is_locked(tmp_path: Path) -> None:
    # Another process holds SQLite's write lock; a request waits for it (up to a minute),
    # holding the one thread (and the one connection) the API's requests share. /metrics
    # needs no database: it answers at once. /healthz answers within its 5 s, 503 if the
    # database has not answered by then (here: its connection is the waiting request's).
    import sqlite3

    db = tmp_path / "bso.sqlite"
    with ServerProcess(f"sqlite:///{db}", tmp_path / "server.log") as server:
        url = server.url
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        waiting = threading.Thread(target=lambda: httpx.post(f"{url}/jobs", json=spec(), timeout=90))
        waiting.start()
        try:
            time.sleep(1.0)  # the POST now waits for the lock
            with httpx.Client(base_url=url, timeout=10) as c:
                t0 = time.monotonic()
                assert c.get("/metrics").status_code == 200
                assert time.monotonic() - t0 < 2.0
                health = c.get("/healthz")
                assert health.status_code == 503 and "no answer within 5 s" in health.text
                assert time.monotonic() - t0 < 8.0
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            waiting.join(timeout=90)


def test_health_probes_of_a_stuck_database_share_one_check(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each probe that gave up left its thread waiting on the database, and the next probe
    started another: threads piled up, each waiting for a connection the API needs too."""
    from fastapi.testclient import TestClient

    from joules.servers.batch_size import app as app_module
    from joules.servers.batch_size import db as dbm

    monkeypatch.setattr(app_module, "HEALTH_TIMEOUT_S", 0.2)
    stuck = threading.Event()
    pings: list[float] = []
    real_ping = dbm.Database.ping

    def ping(self: dbm.Database) -> None:
        pings.append(time.monotonic())
        stuck.wait(30)
        real_ping(self)

    monkeypatch.setattr(dbm.Database, "ping", ping)
    with TestClient(app_module.create_app(f"sqlite:///{tmp_path / 'bso.sqlite'}")) as c:
        for _ in range(4):
            r = c.get("/healthz")
            assert r.status_code == 503 and "no answer within 0.2 s" in r.text
        assert len(pings) == 1  # one check, still running, shared by every probe
        assert sum(t.name == "joules-healthz" for t in threading.enumerate()) == 1
        stuck.set()
        deadline = time.monotonic() + 10
        while (r := c.get("/healthz")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["status"] == "ok"
