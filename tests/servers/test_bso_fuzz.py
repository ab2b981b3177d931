"""Fuzz the server from its own OpenAPI schema (schemathesis): no 5xx, answers conform to the schema.

Runs over real HTTP against the shared test servers (SQLite and PostgreSQL, two workers,
token), with schemathesis' Python API and hypothesis directly: schemathesis 4's pytest
plugin does not run under pytest 9. Kept small (a few examples per operation and mode) so
that the suite stays fast.
"""

from __future__ import annotations

from typing import Any

import pytest
from bso_helpers import Served, register, spec

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

EXAMPLES = 8


def fuzz_operation(operation: Any, mode: GenerationMode, served: Served,
                   path_parameters: dict[str, str] | None, failures: list[str]) -> int:
    """Run ``EXAMPLES`` generated requests to one operation; return how many were sent."""
    sent = [0]
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        sent[0] += 1
        case.call_and_validate(base_url=served.url, headers=served.headers, excluded_checks=excluded)

    # POST /jobs: default_batch_size must be one of batch_sizes, which a JSON schema cannot say,
    # so a schema-valid body may get 422.
    excluded = [positive_data_acceptance] if operation.label == "POST /jobs" else []
    try:
        run()
    except Unsatisfiable:
        pass  # nothing to negate (GET /healthz has no parameters)
    except Exception as e:  # schemathesis' failures (hypothesis re-raises the shrunk one)
        failures.append(f"{operation.label} ({mode.value}): {str(e)[:3000]}")
    return sent[0]


def test_api_conforms_to_its_schema(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec(name="fuzz-job", max_epochs=1000))
        trial = c.post(f"/jobs/{job}/trials").json()["trial_id"]
    schema = schemathesis.openapi.from_url(f"{bso_server.url}/openapi.json")
    failures: list[str] = []
    sent = 0
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /jobs", "GET /jobs/{job_id}", "GET /jobs/{job_id}/trials", "POST /jobs/{job_id}/trials",
        "GET /jobs/{job_id}/trials/{trial_id}", "POST /jobs/{job_id}/trials/{trial_id}/epochs",
        "POST /jobs/{job_id}/trials/{trial_id}/end", "GET /healthz", "GET /metrics"}
    known = {"job_id": job, "trial_id": trial}
    for op in operations:
        names = {p.name for p in op.path_parameters}
        fixed = {k: v for k, v in known.items() if k in names} or None
        # Random ids (mostly 404) and, for operations with ids, the known job and trial too.
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            sent += fuzz_operation(op, mode, bso_server, None, failures)
            if fixed:
                sent += fuzz_operation(op, mode, bso_server, fixed, failures)
    assert not failures, "\n\n".join(failures)
    assert sent >= 10 * len(operations)
