"""The server over the real default model (SmolLM2-135M), driven by the official OpenAI and Anthropic SDKs."""
from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest
from serve_helpers import MODEL, wait_idle

HI = [{"role": "user", "content": "Name three colors."}]



def test_models_listed_for_both_sdks(oai, ant):
    assert [m.id for m in oai.models.list()] == [MODEL, "default"]
    assert oai.models.retrieve("default").id == "default"
    assert [m.id for m in ant.models.list()] == [MODEL, "default"]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_stream_matches_non_stream_under_greedy(oai):
    full = oai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=12)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage.completion_tokens == full.usage.completion_tokens
    # the second identical prompt finds its full KV blocks in the prefix cache
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs_shape(oai, tokenizer):
    r = oai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=4, logprobs=True,
                                    top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    # greedy picks the most likely token
    assert entries[0].token == entries[0].top_logprobs[0].token


def test_seed_reproduces_sampled_text(oai):
    kwargs = dict(model=MODEL, messages=HI, temperature=1.0, top_p=0.9, max_tokens=10)
    a = oai.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    b = oai.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert a == b


def test_completions_with_echo_and_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                               echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith("The capital of France is") and len(choice.text) > len("The capital of France is")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None                    # prompt tokens carry no logprob
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert choice.text == "The capital of France is" + streamed


def test_responses_stream_and_non_stream(oai):
    r = oai.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                             max_output_tokens=6, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6
    events = list(oai.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                       max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events if e.type != "keepalive"]   # a busy CPU may need keep-alives
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_anthropic_messages_stream_and_non_stream(ant):
    # (this SDK version no longer names the sampling fields; the server still reads them)
    greedy = {"temperature": 0}
    msg = ant.messages.create(model=MODEL, max_tokens=10, system="Answer briefly.", messages=HI, extra_body=greedy)
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 10
    with ant.messages.stream(model=MODEL, max_tokens=10, system="Answer briefly.", messages=HI,
                             extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == msg.content[0].text
        final = stream.get_final_message()
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0         # same prompt again: prefix cache hit
    counted = ant.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=HI).input_tokens
    assert counted == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_stop_sequence_is_reported(ant, oai):
    base = oai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=16)
    text = base.choices[0].message.content
    words = re.findall(r"[A-Za-z]{4,}", text)
    stop = words[1] if len(words) > 1 else words[0]
    cut = oai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=16, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    msg = ant.messages.create(model=MODEL, messages=HI, max_tokens=16, stop_sequences=[stop],
                              extra_body={"temperature": 0})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_errors_are_typed_in_both_sdks(oai, ant):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=HI)
    assert e.value.body["code"] == "model_not_found"
    too_long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=too_long, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert re.search(r"maximum context length is 2048 tokens, but the prompt has \d+ tokens.*"
                     r"`lodestar serve --ctx \d+`; this model supports up to 8192", e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=[1, 2, 999_999], max_tokens=2)
    assert "outside the vocabulary" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"temperature": 1.5})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="not-a-served-model", max_tokens=5, messages=HI)
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=4000, messages=too_long)
    assert re.match(r"prompt is too long: \d+ tokens > 2048 maximum", e.value.body["error"]["message"])


def test_disconnect_aborts_streaming_request_and_frees_kv(oai, real_engine):
    stream = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=1500, stream=True,
                                         extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 4:
            break
    assert real_engine.stats()["running"] == 1
    stream.close()
    stats = wait_idle(real_engine, timeout=10)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_disconnect_aborts_non_streaming_request(real_url, real_engine):
    body = {"model": MODEL, "messages": HI, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    stats = wait_idle(real_engine, timeout=10)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_metrics_exposition(real_url, oai):
    for _ in range(2):   # the second run of a prompt reads its prefix from the cache
        oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=HI, top_p=0)
    text = httpx.get(real_url + "/metrics").text
    assert re.search(r'lodestar_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', text)
    assert re.search(r'lodestar_requests_total\{route="/v1/chat/completions",status="400"\} [1-9]', text)
    for name in ("lodestar_prompt_tokens_total", "lodestar_generation_tokens_total", "lodestar_queue_depth",
                 "lodestar_running_sequences", "lodestar_kv_blocks_used", "lodestar_prefix_cache_hit_rate"):
        assert re.search(rf"^{name}\{{model=\"{MODEL}\"\}} [0-9.]+$", text, re.M), name
    ttft_count = re.search(r"^lodestar_time_to_first_token_seconds_count\{.*\} (\d+)$", text, re.M)
    assert ttft_count and int(ttft_count.group(1)) > 0
    assert re.search(r'^lodestar_decode_tokens_per_second_bucket\{.*le="\+Inf"\} [1-9]', text, re.M)
    hit_rate = float(re.search(r"^lodestar_prefix_cache_hit_rate\{.*\} ([0-9.]+)$", text, re.M).group(1))
    assert 0 < hit_rate < 1
