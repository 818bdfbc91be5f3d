"""JSON schemas, tools and prompts of the structured-output benchmark (``lodestar bench structured``).

- ``SCHEMAS``: schemas of everyday shapes (nested objects, bounded arrays, enums, ``anyOf``,
  string formats and patterns, bounded numbers, booleans, nullable fields, closed objects),
  each with a chat prompt asking for such an object and a canonical valid ``instance``.
- ``TOOLS``: OpenAI-style function tools, for forced tool calls.
- ``KEY_HEAVY``: objects with many required long key names and short values, where most of
  the output is forced by the schema (the jump-forward workload).

``instance_text`` is an instance as the engine writes JSON (``json.dumps``: ", " and ": ").
Free strings carry a ``maxLength`` where a small model could otherwise ramble until
``max_tokens``: the benchmark measures the grammar, not the model's sense of when to stop.
Numbers (and fractional seconds of times) stay unbounded, as in schemas people write; a small
model can loop in their digits until ``max_tokens``, which the validity part counts as cut off.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str          # the user message asking for one such object
    instance: Any        # a valid example


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    prompt: str          # a user message this tool answers
    example_arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI ``tools`` entry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def instance_text(entry: SchemaCase) -> str:
    return json.dumps(entry.instance)


def _obj(properties: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    """An object schema; every property required unless ``required`` names fewer."""
    out: dict[str, Any] = {"type": "object", "properties": properties,
                           "required": list(properties) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


def _str(max_length: int = 60, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **kw}


def _email() -> dict[str, Any]:
    return {"type": "string", "format": "email", "maxLength": 40}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _enum(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def _arr(items: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def _ask(what: str) -> str:
    return f"{what} Answer with a single JSON object only."


SCHEMAS: list[SchemaCase] = [
    SchemaCase("person", _obj({"name": _str(40), "age": _int(0, 120), "email": _email()}),
               _ask("Describe a fictional person with their name, age and email address."),
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    SchemaCase("address", _obj({"street": _str(60), "city": _str(40),
                                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                                "country": _enum("US", "DE", "FR", "JP", "BR")}),
               _ask("Give a postal address in Germany or France (five-digit postal code)."),
               {"street": "12 Rue de Rivoli", "city": "Paris", "postal_code": "75004", "country": "FR"}),
    SchemaCase("order", _obj({
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": _obj({"name": _str(40), "email": _email()}),
        "items": _arr(_obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "quantity": _int(1, 99),
                            "unit_price": _num(0, 10000)}), 1, 4)}),
               _ask("Create an online shop order with an order id, the customer and one to four items."),
               {"order_id": "ORD-004211", "customer": {"name": "Kim Lee", "email": "kim@shop.example"},
                "items": [{"sku": "ABC-123", "quantity": 2, "unit_price": 9.99}]}),
    SchemaCase("event", _obj({"title": _str(60), "date": {"type": "string", "format": "date"},
                              "start_time": {"type": "string", "format": "time"},
                              "attendees": _arr(_email(), 1, 4)}),
               _ask("Schedule a team meeting: its title, date, start time and the attendees' emails."),
               {"title": "Sprint review", "date": "2025-03-14", "start_time": "10:30:00Z",
                "attendees": ["sam@example.com", "lee@example.com"]}),
    SchemaCase("weather", _obj({"city": _str(40), "temperature_c": _num(-90, 60),
                                "condition": _enum("sunny", "cloudy", "rain", "snow", "storm"),
                                "humidity_pct": _int(0, 100)}),
               _ask("Report the current weather in Oslo."),
               {"city": "Oslo", "temperature_c": -3.5, "condition": "snow", "humidity_pct": 80}),
    SchemaCase("book", _obj({"title": _str(80), "author": _str(50), "year": _int(1400, 2030),
                             "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                             "genres": _arr(_enum("fiction", "science", "history", "poetry", "fantasy"), 1, 3)}),
               _ask("Describe a well-known book with its title, author, year, ISBN-13 and genres."),
               {"title": "Dune", "author": "Frank Herbert", "year": 1965, "isbn": "9780441172719",
                "genres": ["fiction", "fantasy"]}),
    SchemaCase("user_account", _obj({"id": {"type": "string", "format": "uuid"},
                                     "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                                     "active": {"type": "boolean"},
                                     "created_at": {"type": "string", "format": "date-time"}}),
               _ask("Create a user account record with a UUID, a lowercase username, whether it is active and "
                    "when it was created."),
               {"id": "123e4567-e89b-12d3-a456-426614174000", "username": "ada_l", "active": True,
                "created_at": "2024-05-01T08:15:00Z"}),
    SchemaCase("product", _obj({"name": _str(60), "price": {"type": "number", "exclusiveMinimum": 0},
                                "currency": _enum("USD", "EUR", "GBP", "JPY"), "in_stock": {"type": "boolean"},
                                "tags": _arr(_str(20), 0, 5), "discount_pct": {"type": ["number", "null"]}}),
               _ask("List a product from an electronics shop with price, currency, stock, tags and discount "
                    "(null if none)."),
               {"name": "USB-C cable", "price": 12.5, "currency": "EUR", "in_stock": True,
                "tags": ["cable", "usb"], "discount_pct": None}),
    SchemaCase("movie_review", _obj({"movie": _str(60), "rating": _int(1, 5),
                                     "sentiment": _enum("positive", "mixed", "negative"), "summary": _str(160)}),
               _ask("Write a short review of the movie Inception with a 1-5 rating."),
               {"movie": "Inception", "rating": 5, "sentiment": "positive", "summary": "A clever, layered heist."}),
    SchemaCase("recipe", _obj({"name": _str(50), "servings": _int(1, 12),
                               "ingredients": _arr(_obj({"item": _str(30), "amount": _num(0, 5000),
                                                         "unit": _enum("g", "ml", "piece", "tbsp", "tsp")}), 1, 5),
                               "steps": _arr(_str(100), 2, 5)}),
               _ask("Give a simple pancake recipe with ingredients and steps."),
               {"name": "Pancakes", "servings": 4,
                "ingredients": [{"item": "flour", "amount": 200, "unit": "g"}, {"item": "milk", "amount": 300,
                                                                                  "unit": "ml"}],
                "steps": ["Mix everything.", "Fry in a hot pan."]}),
    SchemaCase("shape", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": _num(0, 100)}),
        _obj({"kind": {"const": "rectangle"}, "width": _num(0, 100), "height": _num(0, 100)})]},
        "color": _enum("red", "green", "blue")}),
               _ask("Describe a geometric shape (a circle or a rectangle) with its size and color."),
               {"shape": {"kind": "rectangle", "width": 4, "height": 2.5}, "color": "blue"}),
    SchemaCase("payment", _obj({"amount": _num(0, 100000), "method": {"anyOf": [
        _obj({"type": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
              "brand": _enum("visa", "mastercard", "amex")}),
        _obj({"type": {"const": "bank_transfer"},
              "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}}),
        _obj({"type": {"const": "cash"}})]}}),
               _ask("Record a payment of 42.50 made by card, bank transfer or cash."),
               {"amount": 42.5, "method": {"type": "card", "last4": "4242", "brand": "visa"}}),
    SchemaCase("contact", _obj({"name": _str(40), "phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{7,14}$"},
                                "email": {"anyOf": [_email(), {"type": "null"}]},
                                "company": {"type": ["string", "null"], "maxLength": 40}}),
               _ask("Add a phone contact with an international phone number; email and company may be null."),
               {"name": "Maria Silva", "phone": "+5511987654321", "email": None, "company": "Acme"}),
    SchemaCase("flight", _obj({"flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                               "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                               "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                               "departure": {"type": "string", "format": "date-time"}, "seats": _int(1, 9),
                               "cabin": _enum("economy", "premium", "business", "first")}),
               _ask("Book a flight from Paris (CDG) to New York (JFK) for two people."),
               {"flight_number": "AF22", "origin": "CDG", "destination": "JFK", "departure": "2025-06-01T09:40:00Z",
                "seats": 2, "cabin": "economy"}),
    SchemaCase("todo_list", _obj({"title": _str(40), "tasks": _arr(_obj({
        "id": _int(1, 100), "text": _str(60), "done": {"type": "boolean"},
        "priority": _enum("low", "medium", "high")}), 1, 4)}),
               _ask("Make a todo list for moving house with up to four tasks."),
               {"title": "Moving", "tasks": [{"id": 1, "text": "Pack books", "done": False, "priority": "high"}]}),
    SchemaCase("server_config", _obj({"host": {"type": "string", "format": "hostname", "maxLength": 60},
                                      "port": _int(1, 65535),
                                      "tls": {"type": "boolean"}, "timeout_s": _num(0.1, 300),
                                      "log_level": _enum("debug", "info", "warning", "error"),
                                      "allowed_ips": _arr({"type": "string", "format": "ipv4"}, 0, 3)}),
               _ask("Write a web server configuration with host, port, TLS, timeout, log level and allowed IPs."),
               {"host": "api.example.com", "port": 8443, "tls": True, "timeout_s": 30, "log_level": "info",
                "allowed_ips": ["10.0.0.1"]}),
    SchemaCase("classification", _obj({"label": _enum("spam", "ham"), "confidence": _num(0, 1),
                                       "keywords": _arr(_str(20), 0, 4)}),
               _ask("Classify this email as spam or ham: 'You won a free cruise, click here to claim!'"),
               {"label": "spam", "confidence": 0.97, "keywords": ["won", "free", "click"]}),
    SchemaCase("invoice", _obj({"invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                                "issue_date": {"type": "string", "format": "date"},
                                "lines": _arr(_obj({"description": _str(50), "qty": _int(1, 1000),
                                                    "unit_price": _num(0, 100000)}), 1, 3),
                                "total": _num(0, 1000000), "paid": {"type": "boolean"},
                                "notes": {"type": ["string", "null"], "maxLength": 80}}),
               _ask("Write an invoice for two hours of consulting at 90 per hour."),
               {"invoice_id": "INV-000117", "issue_date": "2025-01-31",
                "lines": [{"description": "Consulting (hours)", "qty": 2, "unit_price": 90}], "total": 180,
                "paid": False, "notes": None}),
    SchemaCase("geo_location", _obj({"name": _str(50), "latitude": _num(-90, 90), "longitude": _num(-180, 180),
                                     "elevation_m": {"type": ["integer", "null"]}}),
               _ask("Give the coordinates of Mount Fuji."),
               {"name": "Mount Fuji", "latitude": 35.36, "longitude": 138.73, "elevation_m": 3776}),
    SchemaCase("employee", _obj({"name": _str(40), "department": _enum("engineering", "sales", "finance", "hr"),
                                 "salary": _int(10000, 500000),
                                 "manager": {"anyOf": [_obj({"name": _str(40), "employee_id": _int(1, 99999)}),
                                                       {"type": "null"}]},
                                 "skills": _arr(_str(20), 1, 4)}),
               _ask("Describe an employee of a software company, with their manager (or null)."),
               {"name": "Tom Ray", "department": "engineering", "salary": 85000,
                "manager": {"name": "Ana Diaz", "employee_id": 1042}, "skills": ["python", "sql"]}),
    SchemaCase("quiz_question", _obj({"question": _str(120), "options": _arr(_str(40), 4, 4),
                                      "answer_index": _int(0, 3), "difficulty": _enum("easy", "medium", "hard")}),
               _ask("Write a multiple-choice geography question with four options."),
               {"question": "What is the capital of Italy?", "options": ["Rome", "Milan", "Turin", "Naples"],
                "answer_index": 0, "difficulty": "easy"}),
    SchemaCase("api_error", _obj({"status": _int(400, 599), "error": _enum("bad_request", "unauthorized",
                                                                            "not_found", "rate_limited", "internal"),
                                  "message": _str(100), "retry_after_s": {"type": ["integer", "null"],
                                                                           "minimum": 0, "maximum": 3600}}),
               _ask("Produce an HTTP API error response for a client that sent too many requests."),
               {"status": 429, "error": "rate_limited", "message": "Slow down.", "retry_after_s": 30}),
    SchemaCase("math_answer", _obj({"expression": _str(60), "steps": _arr(_str(80), 1, 4), "answer": {"type": "number"},
                                    "verified": {"type": "boolean"}}),
               _ask("Compute 17 * 23 and show the steps."),
               {"expression": "17 * 23", "steps": ["17 * 20 = 340", "17 * 3 = 51", "340 + 51 = 391"],
                "answer": 391, "verified": True}),
    SchemaCase("open_profile", _obj({"handle": {"type": "string", "pattern": "^@[A-Za-z0-9_]{1,15}$"},
                                     "bio": _str(120), "followers": {"type": "integer", "minimum": 0}},
                                    required=["handle", "followers"], closed=False),
               _ask("Create a social media profile with a handle starting with @, a short bio and a follower count."),
               {"handle": "@ada", "bio": "Poet of science.", "followers": 1815}),
    SchemaCase("sensor_batch", _obj({"sensor_id": {"type": "string", "pattern": "^S[0-9]{3}$"},
                                     "unit": _enum("celsius", "fahrenheit"),
                                     "readings": _arr(_num(-50, 150), 3, 6), "healthy": {"type": "boolean"}}),
               _ask("Report a temperature sensor with three to six readings."),
               {"sensor_id": "S014", "unit": "celsius", "readings": [21.5, 21.7, 22.0], "healthy": True}),
]


TOOLS: list[Tool] = [
    Tool("get_weather", "Current weather for a city.",
         _obj({"location": _str(60), "unit": _enum("celsius", "fahrenheit")}, required=["location"]),
         "What's the weather like in Lisbon right now, in celsius?",
         {"location": "Lisbon", "unit": "celsius"}),
    Tool("search_web", "Search the web and return the top results.",
         _obj({"query": _str(100), "max_results": _int(1, 10)}, required=["query"]),
         "Find recent news about the James Webb telescope, five results.",
         {"query": "James Webb telescope news", "max_results": 5}),
    Tool("send_email", "Send an email.",
         _obj({"to": _email(), "subject": _str(80), "body": _str(300)}),
         "Email bob@example.com that the meeting moved to 3pm.",
         {"to": "bob@example.com", "subject": "Meeting moved", "body": "The meeting is now at 3pm."}),
    Tool("create_calendar_event", "Create a calendar event.",
         _obj({"title": _str(60), "date": {"type": "string", "format": "date"}, "duration_minutes": _int(5, 480),
               "attendees": _arr(_email(), 0, 5)}, required=["title", "date"]),
         "Put a one hour dentist appointment in my calendar on 2025-04-02.",
         {"title": "Dentist", "date": "2025-04-02", "duration_minutes": 60}),
    Tool("convert_currency", "Convert an amount between currencies.",
         _obj({"amount": {"type": "number", "exclusiveMinimum": 0},
               "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
               "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
         "How much is 250 US dollars in euros?",
         {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}),
]


KEY_HEAVY: list[SchemaCase] = [
    SchemaCase("customer_record", _obj({
        "customer_account_identifier_number": _int(1, 999999),
        "customer_billing_address_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "customer_billing_address_country_code": _enum("US", "CA", "GB", "DE"),
        "customer_shipping_address_same_as_billing": {"type": "boolean"},
        "customer_preferred_contact_method": _enum("email", "phone", "postal_mail"),
        "customer_marketing_email_opt_in_status": {"type": "boolean"},
        "customer_loyalty_program_membership_tier": _enum("bronze", "silver", "gold", "platinum"),
        "customer_lifetime_completed_order_count": _int(0, 10000),
        "customer_account_suspended_for_fraud_review": {"type": "boolean"}}),
               _ask("Create a customer record for a loyal gold-tier customer in the US."),
               {"customer_account_identifier_number": 48213, "customer_billing_address_postal_code": "94107",
                "customer_billing_address_country_code": "US", "customer_shipping_address_same_as_billing": True,
                "customer_preferred_contact_method": "email", "customer_marketing_email_opt_in_status": False,
                "customer_loyalty_program_membership_tier": "gold", "customer_lifetime_completed_order_count": 57,
                "customer_account_suspended_for_fraud_review": False}),
    SchemaCase("deployment_manifest", _obj({
        "service_deployment_environment_name": _enum("development", "staging", "production"),
        "container_cpu_request_millicores": _int(10, 64000),
        "container_memory_limit_megabytes": _int(16, 262144),
        "horizontal_pod_autoscaler_minimum_replicas": _int(1, 100),
        "horizontal_pod_autoscaler_maximum_replicas": _int(1, 1000),
        "readiness_probe_initial_delay_seconds": _int(0, 600),
        "liveness_probe_period_seconds": _int(1, 600),
        "enable_distributed_tracing_instrumentation": {"type": "boolean"},
        "rolling_update_maximum_unavailable_percentage": _int(0, 100)}),
               _ask("Write the deployment settings of a small production web service."),
               {"service_deployment_environment_name": "production", "container_cpu_request_millicores": 250,
                "container_memory_limit_megabytes": 512, "horizontal_pod_autoscaler_minimum_replicas": 2,
                "horizontal_pod_autoscaler_maximum_replicas": 10, "readiness_probe_initial_delay_seconds": 5,
                "liveness_probe_period_seconds": 10, "enable_distributed_tracing_instrumentation": True,
                "rolling_update_maximum_unavailable_percentage": 25}),
    SchemaCase("clinical_observation", _obj({
        "patient_study_enrollment_identifier": {"type": "string", "pattern": "^P[0-9]{4}$"},
        "systolic_blood_pressure_millimeters_mercury": _int(50, 250),
        "diastolic_blood_pressure_millimeters_mercury": _int(30, 150),
        "resting_heart_rate_beats_per_minute": _int(20, 220),
        "body_temperature_degrees_celsius": _num(30, 45),
        "adverse_event_reported_during_this_visit": {"type": "boolean"},
        "concomitant_medication_changes_since_last_visit": {"type": "boolean"},
        "investigator_assessment_of_overall_condition": _enum("improved", "stable", "worsened")}),
               _ask("Record a routine clinical trial visit of a healthy patient."),
               {"patient_study_enrollment_identifier": "P0042", "systolic_blood_pressure_millimeters_mercury": 120,
                "diastolic_blood_pressure_millimeters_mercury": 80, "resting_heart_rate_beats_per_minute": 64,
                "body_temperature_degrees_celsius": 36.8, "adverse_event_reported_during_this_visit": False,
                "concomitant_medication_changes_since_last_visit": False,
                "investigator_assessment_of_overall_condition": "stable"}),
    SchemaCase("shipment_tracking", _obj({
        "shipment_tracking_reference_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{9}[A-Z]{2}$"},
        "origin_distribution_center_code": _enum("LAX1", "JFK2", "ORD3", "DFW4"),
        "destination_distribution_center_code": _enum("LAX1", "JFK2", "ORD3", "DFW4"),
        "package_declared_weight_kilograms": _num(0, 1000),
        "requires_recipient_signature_on_delivery": {"type": "boolean"},
        "contains_hazardous_materials_declaration": {"type": "boolean"},
        "current_shipment_lifecycle_status": _enum("label_created", "in_transit", "out_for_delivery", "delivered"),
        "estimated_delivery_business_days_remaining": _int(0, 30)}),
               _ask("Give the tracking status of a parcel travelling from Los Angeles to New York."),
               {"shipment_tracking_reference_number": "RA123456789US", "origin_distribution_center_code": "LAX1",
                "destination_distribution_center_code": "JFK2", "package_declared_weight_kilograms": 2.4,
                "requires_recipient_signature_on_delivery": False, "contains_hazardous_materials_declaration": False,
                "current_shipment_lifecycle_status": "in_transit", "estimated_delivery_business_days_remaining": 3}),
]


def tool_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON of one call of any of ``tools``: ``{"name": ..., "arguments": {...}}``."""
    return {"anyOf": [_obj({"name": {"const": t.name}, "arguments": t.parameters}) for t in tools]}


def tool_call_grammar(tools: list[Tool], tokenizer) -> str:
    """The grammar a server builds for ``tool_choice: "required"`` with ``parallel_tool_calls:
    false`` (``serve.structured.tool_grammar``): one call of one of ``tools`` in the model's own
    tool-call syntax (Hermes tags for the default model), arguments held to that tool's schema."""
    from lodestar.serve.structured import tool_grammar
    return tool_grammar(tokenizer, [t.openai() for t in tools], forced=True, parallel=False)


def tool_prompt(tools: list[Tool], question: str) -> list[dict[str, str]]:
    """Chat messages offering ``tools`` in the system prompt and asking ``question``."""
    listing = "\n".join(json.dumps(t.openai()) for t in tools)
    system = ("You can call these functions. To call one, answer with <tool_call>, a newline, a JSON object "
              '{"name": ..., "arguments": {...}}, a newline and </tool_call>.\n' + listing)
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]
