"""The command line as a user drives it: text on stdout, one-line errors with exit code 2."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

LODESTAR = [sys.executable, "-m", "lodestar.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(*args, input=None, timeout=240):
    return subprocess.run(LODESTAR + list(args), capture_output=True, text=True, input=input,
                          timeout=timeout, env=ENV)


def test_generate_streams_text_and_stats(smollm_path):
    r = run("generate", "-p", "What is the capital of France?", "-n", "16", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout


def test_generate_without_the_compiled_kernels_gives_the_same_text(smollm_path):
    # LODESTAR_NATIVE=0: the pure-torch forms a machine without a C compiler runs (the same
    # bits for the matrix products; norms, activations and attention differ in the last bits).
    args = ("generate", "-p", "List three colors:", "-n", "12", "--threads", "1", "-q")
    native = run(*args)
    fallback = subprocess.run(LODESTAR + list(args), capture_output=True, text=True, timeout=240,
                              env={**ENV, "LODESTAR_NATIVE": "0"})
    assert native.returncode == 0 and fallback.returncode == 0, native.stderr + fallback.stderr
    assert fallback.stdout == native.stdout and native.stdout.strip()


def test_generate_raw_gemma(gemma_path):
    r = run("generate", "-p", "The capital of France is", "--model", "gemma3-270m", "-n", "8", "-q")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout or "capital" in r.stdout
    assert r.stderr.strip() == "" or "tok/s" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--model", "/no/such/file.gguf"], "not found"),
    (["--model", __file__], "not a GGUF file"),
    (["--temperature", "-1"], "temperature"),
])
def test_bad_input_is_one_line_exit_2(args, needle, smollm_path):
    r = run("generate", "-p", "hi", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_prompt_longer_than_context(smollm_path):
    r = run("generate", "-p", "hello " * 300, "--raw", "--ctx", "256")
    assert r.returncode == 2
    assert "exceeds the context of 256" in r.stderr and "Traceback" not in r.stderr


def test_models_lists_both(smollm_path, gemma_path):
    r = run("models")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout and "gemma3-270m" in r.stdout
    assert "Q4_1" in r.stdout and "sha256" in r.stdout


def test_chat_commands_and_turns(smollm_path):
    script = "/help\nWhat is 2+2?\n/system Answer in one word.\nName a color.\n/quit\n"
    r = run("chat", "--temperature", "0", "-n", "24", input=script)
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stderr                      # help text
    assert "system prompt set" in r.stderr
    assert r.stderr.count("tok/s") == 2              # one stats line per reply
    assert len(r.stdout.strip()) > 0


def test_chat_ctrl_c_stops_answer_not_program(smollm_path):
    # A runner started in the background (`cmd &`) ignores SIGINT, and the child would inherit
    # that: give it the default disposition, so Python installs its KeyboardInterrupt handler.
    p = subprocess.Popen(LODESTAR + ["chat", "-n", "2000", "--ignore-eos", "--threads", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdin.write("Tell me a very long story.\n")
        p.stdin.flush()
        p.stdout.read(20)                             # the answer is streaming
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.stdin.write("/quit\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "interrupted" in err


# -- structured output flags -------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_generate_json_schema_output_is_valid_json(smollm_path, tmp_path):
    import json

    import jsonschema
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = run("generate", "-p", "Describe a person as JSON.", "--json-schema", str(schema), "-n", "30",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), PERSON)
    assert "forced by the grammar" in r.stderr and "finish: stop" in r.stderr


def test_generate_choice_and_regex(smollm_path):
    r = run("generate", "-p", "Is the sky blue? Answer yes or no.", "--choice", "yes", "--choice", "no", "-n", "5",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("yes", "no")
    r = run("generate", "-p", "Give a date.", "--regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "--no-jump-forward", "-n", "20",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    import re
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.stdout.strip()), r.stdout
    assert "(0 forced by the grammar)" in r.stderr


@pytest.mark.parametrize("make,needle", [
    (lambda d: ["--json-schema", str(d / "missing.json")], "--json-schema"),
    (lambda d: ["--json-schema", str(_write(d / "bad.json", "{not json"))], "--json-schema: the JSON schema is not"),
    (lambda d: ["--json-schema", str(_write(d / "list.json", "[1, 2]"))], "--json-schema: a JSON schema must be"),
    (lambda d: ["--regex", "[a-"], "--regex:"),
    (lambda d: ["--grammar", str(_write(d / "bad.lark", "start: ::= ???"))], "--grammar:"),
    (lambda d: ["--choice", ""], "--choice:"),
])
def test_bad_grammar_flag_is_one_line_exit_2(make, needle, smollm_path, tmp_path):
    r = run("generate", "-p", "hi", "-n", "4", "--threads", "1", *make(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("loading")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_grammar_flags_are_mutually_exclusive():
    r = run("generate", "-p", "hi", "--regex", "a", "--choice", "a")
    assert r.returncode == 2 and "not allowed with" in r.stderr


def _write(path, text):
    path.write_text(text)
    return path


# -- speculative decoding flags ------------------------------------------------------
REPEAT_LIST = ("Repeat this list exactly, one item per line: 1. red apple 2. green pear 3. yellow lemon "
               "4. purple plum 5. orange peach")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("args,needle", [
    (["--num-spec-tokens", "0"], "--num-spec-tokens 0: must be in [1, 16]"),
    (["--spec", "ngram", "--num-spec-tokens", "17"], "--num-spec-tokens 17"),
    (["--spec", "ngram", "--spec-ngram", "5", "2"], "--spec-ngram 5 2"),
    (["--spec", "draft"], "--spec draft needs --draft-model"),
    (["--draft-model", "smollm2-135m"], "--draft-model needs --spec draft"),
    (["--spec", "ngram", "--draft-model", "smollm2-135m"], "--draft-model is for --spec draft"),
    (["--spec", "draft", "--draft-model", "smollm2-135m", "--tensor-parallel", "2"], "--tensor-parallel"),
])
def test_bad_spec_flag_is_one_line_exit_2_before_loading(command, args, needle, capsys):
    from lodestar.cli import main
    prompt = ["-p", "hi"] if command == "generate" else []
    port = ["--port", "0"] if command == "serve" else []
    # the model path does not exist: a flag error that came after loading would name it instead
    assert main([command, *prompt, *port, "--model", "/no/such/model.gguf", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_generate_spec_ngram_reports_speculation_and_keeps_the_text(smollm_path):
    plain = run("generate", "-p", REPEAT_LIST, "-n", "32", "--threads", "1")
    spec = run("generate", "-p", REPEAT_LIST, "-n", "32", "--threads", "1", "--spec", "ngram")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout                # greedy output does not change
    assert "| spec:" not in plain.stderr
    m = re.search(r"\| spec: (\d+) drafted, (\d+) accepted \((\d+)%\), (\d+) verify steps, ([0-9.]+) tok/step",
                  spec.stderr)
    assert m, spec.stderr
    drafted, accepted, steps = int(m.group(1)), int(m.group(2)), int(m.group(4))
    assert drafted > 0 and 0 < accepted <= drafted and steps > 0 and float(m.group(5)) > 1.0


def test_generate_missing_draft_model_is_one_line_exit_2(smollm_path):
    r = run("generate", "-p", "hi", "-n", "4", "--threads", "1", "--spec", "draft", "--draft-model",
            "/no/such/draft.gguf")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("loading")]
    assert len(lines) == 1 and "/no/such/draft.gguf" in lines[0] and "Traceback" not in r.stderr, r.stderr
