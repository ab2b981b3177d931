"""The HTTP application of the batch-size optimizer server (FastAPI).

:func:`create_app` builds it for one database; :func:`app_from_env` does the same from
environment variables, for ``uvicorn --factory`` and for the worker processes that
``joules serve --workers N`` starts. The endpoints and wire format are in
:mod:`joules.servers.batch_size.schemas`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import importlib
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from anyio import to_thread
from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from joules.servers.batch_size import db as dbm
from joules.servers.batch_size.schemas import (
    PRINTABLE_PATTERN,
    EpochAnswer,
    EpochReport,
    JobCreate,
    JobOut,
    JobState,
    TrialCreate,
    TrialEnd,
    TrialOut,
    token_problem,
)
from joules.servers.batch_size.service import BatchSizeService, InvalidError, PolicyFactory, ServiceError
from joules.servers.batch_size.settings import (
    DB_ENV,
    MIGRATED_ENV,
    POLICY_ENV,
    TOKEN_ENV,
    default_database_url,
)

METRICS_PREFIX = "joules_bso"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ErrorOut(BaseModel):
    """An error: what is wrong, naming the object or field at fault."""

    detail: str


class HealthOut(BaseModel):
    """The server is up and its database answers."""

    status: str
    database: str
    revision: str | None


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": description}


UNAUTHORIZED = {401: _error("Missing or wrong bearer token.")}
UNAVAILABLE = {503: _error("The database is unavailable; retry later.")}
JOB_NOT_FOUND = {404: _error("Unknown job.")}
TRIAL_NOT_FOUND = {404: _error("Unknown job or trial.")}

MAX_TRIALS_PAGE = 1000  # most trials one GET /jobs/{job_id}/trials returns (its default limit)
MAX_TRIALS_OFFSET = 2**31 - 1  # a job never has that many trials (the database's limit is 2**63 - 1)


class TrialPage(BaseModel):
    """The query of ``GET /jobs/{job_id}/trials`` (other parameters: 422)."""

    model_config = ConfigDict(extra="forbid")

    offset: int = Field(0, ge=0, le=MAX_TRIALS_OFFSET, description="Skip this many of the oldest trials.")
    limit: int = Field(MAX_TRIALS_PAGE, ge=1, le=MAX_TRIALS_PAGE, description="At most this many trials.")


JobId = Path(min_length=1, max_length=64, pattern=PRINTABLE_PATTERN,
             description="The job's id (``job_id`` from ``POST /jobs``).")
TrialId = Path(min_length=1, max_length=64, pattern=PRINTABLE_PATTERN,
               description="The trial's id (``trial_id`` from ``POST .../trials``).")


class Metrics:
    """The server's Prometheus metrics (in the registry of one app).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``joules serve --workers N`` sets it), every worker
    process writes its values there and ``/metrics`` adds them up over all workers.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        p, r = METRICS_PREFIX, self.registry
        self.requests = Counter(f"{p}_requests", "HTTP requests.", ["method", "route", "status"], registry=r)
        self.latency = Histogram(
            f"{p}_request_duration_seconds", "Time to answer an HTTP request, s.", ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r)
        self.jobs_registered = Counter(f"{p}_jobs_registered", "Jobs registered.", registry=r)
        self.trials_started = Counter(f"{p}_trials_started", "Trials started.", registry=r)
        self.trials_ended = Counter(f"{p}_trials_ended", "Trials ended, by outcome.", ["outcome"], registry=r)
        self.epoch_reports = Counter(
            f"{p}_epoch_reports", "Epoch reports: new, or repeated (a retry: counted once).", ["kind"],
            registry=r)
        for outcome in ("reached", "max_epochs", "early_stopped", "aborted", "failed"):
            self.trials_ended.labels(outcome)
        for kind in ("new", "repeated"):
            self.epoch_reports.labels(kind)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (summed over worker processes in multiprocess mode)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts requests and times them, labelled by route template (not by raw path)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None)
            if template is None and 200 <= status[0] < 300:
                # A fixed path of the app's own that is no API route (/docs, /openapi.json): only
                # those answer 2xx without one, so the label set stays bounded.
                template = scope.get("path")
            template = template or "unmatched"
            method = scope.get("method", "")
            if method not in _METHODS:  # a client's made-up method would add a series each
                method = "other"
            self.metrics.requests.labels(method, template, str(status[0])).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - start)


def _bearer_check(token: str | None) -> Callable[..., Awaitable[None]]:
    scheme = HTTPBearer(auto_error=False, description="Needed when the server was started with a token.")

    # async: it does no I/O, so it runs on the event loop instead of taking a thread.
    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        if token is None:
            return
        if credentials is None:
            raise _Unauthorized("missing bearer token: send 'Authorization: Bearer TOKEN'")
        if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
            raise _Unauthorized("wrong bearer token")

    return check


class _Unauthorized(Exception):
    pass


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_MAX_ECHO_DEPTH = 32
HEALTH_TIMEOUT_S = 5.0


def _json_safe(value: Any, depth: int = 0) -> Any:
    r"""``value`` made writable as JSON text.

    Every NaN or infinite float becomes its string (``"nan"``, ``"inf"``), a string that UTF-8
    cannot hold (a lone surrogate, which JSON's ``\ud800`` escapes can make) gets it escaped,
    and bytes (a body that was not JSON) are decoded, what is not UTF-8 replaced. What lies
    deeper than 32 levels (a body nested hundreds deep) is cut to ``"..."``: echoing it would
    exhaust the stack.
    """
    if depth > _MAX_ECHO_DEPTH and isinstance(value, dict | list | tuple):
        return "..."
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_json_safe(k, depth + 1): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v, depth + 1) for v in value]
    return value


class _OneAtATime:
    """Runs a blocking check on a thread of its own, one at a time: callers share the one running.

    A health check stuck on a locked or unreachable database would otherwise leave one more
    thread behind at every probe (a probe gives up after ``HEALTH_TIMEOUT_S``), each then
    waiting for a database connection the API's requests need too.
    """

    def __init__(self, check: Callable[[], Any]) -> None:
        self._check = check
        self._lock = threading.Lock()
        self._running: concurrent.futures.Future[Any] | None = None

    def start(self) -> concurrent.futures.Future[Any]:
        """The check running now, or a new one if none is."""
        with self._lock:
            if self._running is not None and not self._running.done():
                return self._running
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_running_or_notify_cancel()

            def run() -> None:
                try:
                    future.set_result(self._check())
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting probe
                    future.set_exception(e)

            # A daemon thread: one stuck on the database does not hold the server's exit up.
            threading.Thread(target=run, name="joules-healthz", daemon=True).start()
            self._running = future
            return future


def create_app(
    database_url: str,
    token: str | None = None,
    policy_factory: PolicyFactory | None = None,
    migrate: bool = True,
) -> FastAPI:
    """The server's application for one database.

    Args:
        database_url: ``sqlite:///PATH`` or ``postgresql://USER@HOST:PORT/DB`` (a plain path is
            taken as a SQLite file).
        token: When set, every ``/jobs`` request needs ``Authorization: Bearer TOKEN``
            (``/healthz``, ``/metrics`` and the API docs stay open).
        policy_factory: Makes a job's policy (default:
            ``joules.optimizers.batch_size.policy.make_policy``, imported on first use).
        migrate: Bring the database's schema up to date first (safe when several processes
            start at once).

    Raises:
        ValueError: A token that is empty or starts or ends with whitespace (see
            :func:`token_problem`).
        JoulesError: Bad URL or missing driver.
        sqlalchemy.exc.OperationalError: The database cannot be reached.
    """
    if token is not None and (problem := token_problem(token)) is not None:
        raise ValueError(f"the token {problem}")
    database = dbm.Database(database_url)
    if migrate:
        dbm.upgrade(database)
    service = BatchSizeService(database, policy_factory=policy_factory)
    metrics = Metrics()
    service.on_expired = lambda n: metrics.trials_ended.labels("aborted").inc(n)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The endpoints are plain functions, run in threads: by default up to 40 at once. More
        # threads than the pool has connections only queue for a connection and contend for
        # the interpreter; with as many as connections, the load benchmark's reports/s on
        # PostgreSQL rose by a quarter to a third (docs/benchmarks.md, section 7).
        to_thread.current_default_thread_limiter().total_tokens = database.concurrency
        yield
        database.dispose()

    app = FastAPI(
        title="joules batch-size optimizer",
        version="1",
        description="Chooses the batch size of recurring training jobs. See docs/batch-size-server.md.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.metrics = metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    auth = [Depends(_bearer_check(token))]

    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, InvalidError):
            return JSONResponse(status_code=422, content={"detail": [
                {"type": "value_error", "loc": list(exc.loc), "msg": str(exc), "input": None}]})
        return JSONResponse(status_code=exc.status_code, content={"detail": str(exc)})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler fails (500) on an input it echoes that JSON text cannot hold (a
        # NaN or infinite number, a lone surrogate, bytes that are not UTF-8): made safe first.
        errors = jsonable_encoder(_json_safe(exc.errors()))
        return JSONResponse(status_code=422, content={"detail": _json_safe(errors)})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body that is not even text (JSON that does not parse gets 422).
            return JSONResponse(status_code=422, content={"detail": [
                {"type": "json_invalid", "loc": ["body"], "msg": "the body is not valid JSON (UTF-8)",
                 "input": None}]})
        return await http_exception_handler(request, exc)

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_request: Request, exc: _Unauthorized) -> JSONResponse:
        return JSONResponse(status_code=401, content={"detail": str(exc)},
                            headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(OperationalError)
    async def _db_unavailable(_request: Request, exc: DBAPIError) -> JSONResponse:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        return JSONResponse(status_code=503, content={"detail": f"database unavailable: {first}"},
                            headers={"Retry-After": "1"})

    def check_database() -> HealthOut:
        database.ping()
        return HealthOut(status="ok", database=database.url.get_backend_name(),
                         revision=dbm.current_revision(database))

    health = _OneAtATime(check_database)

    @app.get("/healthz", response_model=HealthOut, responses=UNAVAILABLE, tags=["server"])
    async def healthz() -> Any:  # HealthOut, or a 503 JSONResponse
        """Whether the server and its database answer (503 after 5 s without an answer)."""
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            # Shielded: a probe that gives up leaves the check running for the next one.
            return await asyncio.shield(asyncio.wrap_future(health.start()))
        return JSONResponse(status_code=503, headers={"Retry-After": "1"}, content={
            "detail": f"database unavailable: no answer within {HEALTH_TIMEOUT_S:g} s"})

    # async: no database work, so it never waits for a thread behind the API's requests.
    @app.get("/metrics", response_class=PlainTextResponse, tags=["server"],
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus metrics."}})
    async def prometheus_metrics() -> Response:
        """Prometheus metrics: requests, latency, trials started and ended by outcome, epoch reports."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/jobs", response_model=JobOut, status_code=201, dependencies=auth, tags=["jobs"],
              responses={200: {"model": JobOut, "description": "Already registered with the same spec."},
                         409: _error("The name is registered with another spec."),
                         **UNAUTHORIZED, **UNAVAILABLE})
    def register_job(spec: JobCreate, response: Response) -> JobOut:
        """Register a recurring job (again: the same spec gets the same job back, with 200)."""
        job, created = service.register(spec)
        if created:
            metrics.jobs_registered.inc()
        else:
            response.status_code = 200
        return job

    @app.get("/jobs/{job_id}", response_model=JobState, dependencies=auth, tags=["jobs"],
             responses={**JOB_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE})
    def get_job(job_id: str = JobId) -> JobState:
        """A job, where its policy stands, and its trial counts."""
        return service.job_state(job_id)

    @app.get("/jobs/{job_id}/trials", response_model=list[TrialOut], dependencies=auth, tags=["trials"],
             responses={**JOB_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE})
    def list_trials(page: Annotated[TrialPage, Query()], job_id: str = JobId) -> list[TrialOut]:
        """The job's trials, oldest first (a page: ``offset``, ``limit``)."""
        return service.trials(job_id, offset=page.offset, limit=page.limit)

    @app.post("/jobs/{job_id}/trials", response_model=TrialOut, status_code=201, dependencies=auth,
              tags=["trials"], responses={
                  200: {"model": TrialOut,
                        "description": "The trial an earlier request with this request_id made."},
                  **JOB_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE})
    def start_trial(response: Response, request: TrialCreate | None = None, job_id: str = JobId) -> TrialOut:
        """Start a trial: the batch size to train with, and the cost at which it would be stopped."""
        trial, created = service.start_trial(job_id, request or TrialCreate())
        if created:
            metrics.trials_started.inc()
        else:
            response.status_code = 200
        return trial

    @app.get("/jobs/{job_id}/trials/{trial_id}", response_model=TrialOut, dependencies=auth, tags=["trials"],
             responses={**TRIAL_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE})
    def get_trial(job_id: str = JobId, trial_id: str = TrialId) -> TrialOut:
        """One trial."""
        return service.trial(job_id, trial_id)

    @app.post("/jobs/{job_id}/trials/{trial_id}/epochs", response_model=EpochAnswer, dependencies=auth,
              tags=["trials"], responses={
                  **TRIAL_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE,
                  409: _error("The epoch was reported with other values, is not the next one, "
                              "or the trial has ended.")})
    def report_epoch(report: EpochReport, job_id: str = JobId, trial_id: str = TrialId) -> EpochAnswer:
        """Report one epoch; the answer says whether to stop. The same report again gets the same answer."""
        result = service.report(job_id, trial_id, report)
        metrics.epoch_reports.labels("repeated" if result.repeated else "new").inc()
        if result.ended is not None and result.ended.outcome is not None:
            metrics.trials_ended.labels(result.ended.outcome).inc()
        return result.answer

    @app.post("/jobs/{job_id}/trials/{trial_id}/end", response_model=TrialOut, dependencies=auth,
              tags=["trials"], responses={**TRIAL_NOT_FOUND, **UNAUTHORIZED, **UNAVAILABLE})
    def end_trial(request: TrialEnd | None = None, job_id: str = JobId, trial_id: str = TrialId) -> TrialOut:
        """End a trial: ``completed`` (its reports tell how), ``aborted`` or ``failed``; again: no change.

        ``aborted``: it crashed, which says nothing about the batch size. ``failed``: the batch size
        cannot train (out of memory, diverged), and is pruned.
        """
        trial, ended = service.end_trial(job_id, trial_id, request or TrialEnd())
        if ended and trial.outcome is not None:
            metrics.trials_ended.labels(trial.outcome).inc()
        return trial

    return app


def load_policy_factory(spec: str | None) -> PolicyFactory | None:
    """``"module:attribute"`` -> that callable (``None``/empty: the default policy)."""
    if not spec:
        return None
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"bad policy factory {spec!r}: expected module:attribute")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"bad policy factory {spec!r}: {e}") from e
    if not callable(factory):
        raise ValueError(f"policy factory {spec!r} is not callable")
    return factory


def app_from_env() -> FastAPI:
    """:func:`create_app` with its settings from the environment.

    ``JOULES_SERVER_DB`` (default: the SQLite file in the state directory),
    ``JOULES_SERVER_TOKEN`` and (tests) ``JOULES_SERVER_POLICY_FACTORY`` (``module:attribute``).
    The database is migrated first unless ``JOULES_SERVER_MIGRATED`` names that same database
    (``joules serve --workers N`` migrates once, then starts its workers with it set).

    For ``uvicorn --factory joules.servers.batch_size.app:app_from_env`` and the workers of
    ``joules serve --workers N``.
    """
    url = os.environ.get(DB_ENV) or default_database_url()
    token = os.environ.get(TOKEN_ENV)  # set but empty: refused (a secret that failed to load)
    return create_app(url, token=token,
                      policy_factory=load_policy_factory(os.environ.get(POLICY_ENV)),
                      migrate=os.environ.get(MIGRATED_ENV) != url)
