"""Schema-driven fuzzing of every route (against the engine double): no input may cause a 5xx."""
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from serve_helpers import MODEL

EXAMPLES_PER_ROUTE = 25


def test_openapi_document_fuzzing_finds_no_server_error(fake_url):
    schema = schemathesis.openapi.from_url(fake_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
        "POST /v1/messages/count_tokens", "GET /v1/models", "GET /v1/models/{model_id}", "GET /health",
        "GET /metrics"}
    statuses = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL     # past the model check, into the request handling
            statuses.append(case.call_and_validate(checks=[not_a_server_error], timeout=10).status_code)

        fuzz()
    # the run reached generation, not only validation errors
    assert statuses.count(200) >= 20 and statuses.count(400) >= 20
