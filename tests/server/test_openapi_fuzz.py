"""The contract, fuzzed: schemathesis generates requests from the live server's ``/openapi.json``
for every route and checks each answer: never a 5xx, only documented status codes and content
types, and bodies that match the documented schemas.

Bounded so that the suite stays in its budget: a few examples per route, and each generation
request's work capped (``n``, ``max_tokens``) before it is sent, since what is fuzzed is the
contract, not the engine's throughput.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Generated examples per route; nine routes.
EXAMPLES_PER_ROUTE = 100
# Caps on one fuzzed generation request's work.
MAX_N = 2
MAX_TOKENS = 4


def cap_work(body) -> None:
    """Keep a generated request's meaning but bound its work."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], MAX_N)
        if isinstance(body.get("best_of"), int):
            body["best_of"] = body["n"]
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], MAX_TOKENS)
    if isinstance(body.get("min_tokens"), int) and not isinstance(body["min_tokens"], bool):
        body["min_tokens"] = min(body["min_tokens"], MAX_TOKENS)


def test_every_answer_keeps_the_documented_contract(server):
    schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9, [op.label for op in operations]
    failures = {}
    statuses: dict[int, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, derandomize=True)
        def fuzz(case):
            cap_work(case.body)
            response = case.call(timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=CHECKS)

        try:
            fuzz()
        except Exception as exc:  # noqa: BLE001 - collected, all reported at once below
            failures[operation.label] = exc
    assert not failures, "\n\n".join(f"{label}: {exc}" for label, exc in failures.items())
    # Both sides of the contract were exercised: answers and refusals.
    assert statuses.get(200, 0) >= len(operations) and statuses.get(400, 0) > 0, statuses
    print("schemathesis answers by status:", dict(sorted(statuses.items())))
