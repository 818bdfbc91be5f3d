import pytest

from lodestar.serve.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning


def stream(text: str, size: int, in_reasoning: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    parts = []
    for i in range(0, len(text), size):
        parts += parser.feed(text[i:i + size])
    parts += parser.flush()
    assert all(t for _, t in parts), "no empty pieces"
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))


CASES = [
    ("<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", False, ("Let me add 2 and 2.", "The answer is 4.")),
    ("plain answer, no tags", False, ("", "plain answer, no tags")),
    ("I weigh it up.\n</think>\n\nYes.", True, ("I weigh it up.", "Yes.")),
    ("<think>cut off by max_tokens", False, ("cut off by max_tokens", "")),
    ("Intro <think>aside</think> outro", False, ("aside", "Intro outro")),
    ("a < b and </thin is not a tag", False, ("", "a < b and </thin is not a tag")),
    ("<think>\n\n</think>\n\nNo thinking today.", False, ("", "No thinking today.")),
]


@pytest.mark.parametrize("text,in_reasoning,expected", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_split_matches_whole_split(text, in_reasoning, expected, size):
    assert split_reasoning(text, in_reasoning) == expected
    assert stream(text, size, in_reasoning) == expected


def test_no_piece_of_a_tag_leaks_while_streaming():
    parser = ReasoningParser()
    out = parser.feed("<thi") + parser.feed("nk>deep") + parser.feed(" thought</th")
    assert out == [("reasoning", "deep"), ("reasoning", " thought")]
    assert parser.feed("ink>Done") == [("content", "Done")]


def test_prompt_that_opens_a_think_span():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
