"""tools/ask.py end to end on a tiny fixture: template + tokenizer here, ids through the worker, text streamed."""
import subprocess
import sys
from pathlib import Path

from engine.tokenizer import Tokenizer
from tools import ask
from tools.batch import WorkerClient

ROOT = Path(__file__).resolve().parent.parent


def test_ask_streams_the_same_answer_as_the_protocol(fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-llama-legacy.gguf"
    p = subprocess.run([sys.executable, "-m", "tools.ask", "--model", str(model), "--backend", "cpu",
                        "--max-new", "12", "hello there"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    ids, tok = ask.build_prompt(model, "hello there", None)
    # the fixture's ChatML template opens the turn with <|im_start|>, parsed as the special token
    assert tok.token_text(ids[0]) == "<|im_start|>"
    with WorkerClient(model, ["--backend", "cpu"], stderr=subprocess.DEVNULL) as w:
        res = w.generate(ask.parse_gen(ask.format_gen(ask.GenRequest(12, ids, {}))))
    assert p.stdout == Tokenizer.from_gguf(model).decode(res["tokens"]) + "\n"
    assert f"[{res['generated']} tokens, {res['finish']}" in p.stderr


def test_ask_refuses_bad_input_with_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    p = subprocess.run([sys.executable, "-m", "tools.ask", "--model", str(bad), "hi"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith("ask: ") and "Traceback" not in p.stderr


def test_ctrl_c_stops_the_answer_through_the_protocol(fixtures_dir):
    import signal
    model = fixtures_dir / "reference" / "tiny-llama-legacy.gguf"
    p = subprocess.Popen([sys.executable, "-m", "tools.ask", "--model", str(model), "--backend", "cpu",
                          "--max-new", "1900", "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stdout.read(1)          # the answer has started streaming
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert b"tokens, cancel," in err
