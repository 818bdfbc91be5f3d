import pytest

from lodestar.serve.chat_prompt import PLAIN_STOP, render_chat
from lodestar.serve.errors import APIError
from lodestar.tokenizer import render_chat_template

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": CITY}}]
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]

# A template that reads tools, tool calls and tool results itself (shaped like Qwen's).
NATIVE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
          "{% for m in messages %}[{{ m.role }}]"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
          "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% if enable_thinking %}<think>\n{% endif %}{% endif %}")


class StubTokenizer:
    """Just enough tokenizer: one id per character."""

    def __init__(self, template=None):
        self.chat_template = template

    @property
    def has_chat_template(self):
        return self.chat_template is not None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False,
                            continue_final_message=False, **kwargs):
        return render_chat_template(self.chat_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **kwargs)


def test_tools_injected_as_hermes_block_when_template_ignores_them(tokenizer):
    prompt = render_chat(tokenizer, ROUND_TRIP, TOOLS)
    text = prompt.text
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    # the earlier call is written back in the syntax the parser reads, the result as a tool response
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt.ids == tokenizer.encode(text, add_special_tokens=False)


def test_system_message_keeps_its_text_before_the_tools_block(tokenizer):
    text = render_chat(tokenizer, [{"role": "system", "content": "Be brief."}] + ROUND_TRIP[:1], TOOLS).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_native_template_gets_tools_and_parsed_arguments():
    prompt = render_chat(StubTokenizer(NATIVE), ROUND_TRIP, TOOLS, enable_thinking=True)
    assert prompt.text.startswith("TOOLS:get_weather;")
    assert "[assistant]CALL get_weather Paris" in prompt.text   # arguments reach the template as a mapping
    assert "[tool]18 C, sunny" in prompt.text
    assert prompt.in_reasoning                                   # the generation prompt opened <think>
    assert not render_chat(StubTokenizer(NATIVE), ROUND_TRIP, TOOLS, enable_thinking=False).in_reasoning


def test_model_without_template_gets_plain_transcript_and_stop():
    prompt = render_chat(StubTokenizer(None), [{"role": "system", "content": "Be kind."},
                                              {"role": "user", "content": "Hi"}])
    assert prompt.text == "System: Be kind.\nUser: Hi\nAssistant:"
    assert prompt.stop == [PLAIN_STOP]


def test_final_assistant_message_is_continued():
    prompt = render_chat(StubTokenizer(None), [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Well,"}], continue_final=True)
    assert prompt.text == "User: Hi\nAssistant: Well,"


def test_template_error_is_a_400():
    bad = StubTokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError) as e:
        render_chat(bad, [{"role": "user", "content": "x"}])
    assert e.value.status == 400 and "roles must alternate" in e.value.message
