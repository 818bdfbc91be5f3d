"""`lodestar bench startup`: first-token times measured from outside the processes."""
import json

from lodestar.cli import main


def test_startup_times_generate_and_both_chat_turns(smollm_path, tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--threads", "1", "--runs", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == smollm_path.name
    for key in ("import_torch_s", "generate_first_token_s", "chat_first_token_s", "chat_second_turn_s"):
        assert len(doc[key]["runs"]) == 1 and doc[key]["median"] > 0, key
    # The generate process imports torch and loads the model before its first token; a
    # chat turn runs in a process that already has.
    assert doc["generate_first_token_s"]["median"] > doc["import_torch_s"]["median"]
    assert doc["generate_first_token_s"]["median"] > doc["chat_second_turn_s"]["median"]
    assert "generate_first_token_s" in capsys.readouterr().out
