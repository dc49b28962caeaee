"""The real worker as a subprocess, driven through its pipes (issue 2's protocol checks), on the CPU backend.

The protocol checks run on a dense model and on a tiny model of each hybrid architecture (qwen3next, qwen35moe,
qwen4exp: recurrent layers, so prefix reuse goes through checkpoints), made by tools/make_moe.py once per test
session.
Every read has a deadline, so a worker that hangs fails the test instead of hanging the suite.
"""
import os
import queue
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine import protocol

ROOT = Path(__file__).resolve().parent.parent
WORKER = [sys.executable, str(ROOT / "strata_worker.py")]
TIMEOUT = 120.0
MODEL = "tiny-llama-legacy.gguf"
# The model fixture's files: llama.cpp's reference model, and the hybrids' make_moe presets.
ARCH = {"tiny-llama-legacy": "llama", "tiny-qwen3next": "qwen3next", "tiny-qwen35moe": "qwen35moe",
        "tiny-qwen4exp": "qwen4exp"}
HYBRIDS = ("tiny-qwen3next", "tiny-qwen35moe", "tiny-qwen4exp")
# The same protocol checks run against the CUDA backend on the GPU machine: STRATA_TEST_BACKEND=cuda.
BACKEND = os.environ.get("STRATA_TEST_BACKEND", "cpu")


def skip_unless_backend_runs(stem: str) -> None:
    from engine.supported import runs_on
    arch = ARCH.get(stem.removesuffix(".gguf"))
    if arch is not None and not runs_on(arch, BACKEND, preview=True):
        pytest.skip(f"the {BACKEND} backend does not run {arch} (engine/supported.py)")


class Worker:
    def __init__(self, model, *flags):
        self.proc = subprocess.Popen([*WORKER, "--model", str(model), "--backend", BACKEND, *flags],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, cwd=ROOT)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._drain_err, daemon=True).start()
        self.info = {}
        while True:
            line = self.read()
            if line.startswith("READY"):
                self.ready = line
                break
            assert protocol.kind(line) == "INFO", f"before READY only INFO lines may come, got {line!r}"
            self.info.update(protocol.parse_info(line))

    @staticmethod
    def _pump(stream, q):
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def _drain_err(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def read(self) -> str:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"worker silent for {TIMEOUT} s; stderr: {''.join(self.stderr)[-2000:]}")
        assert line is not None, f"worker exited ({self.proc.wait()}); stderr: {''.join(self.stderr)[-2000:]}"
        return line

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def request(self, line) -> list[str]:
        """Send a GEN and read to its DONE or ERR (CACHE lines, if any, are skipped)."""
        self.send(line)
        return self.collect()

    def collect(self) -> list[str]:
        out = []
        while True:
            line = self.read()
            if protocol.kind(line) in ("CACHE", "INFO"):
                continue
            out.append(line)
            if line.startswith(("DONE", "ERR")):
                return out

    def quit(self) -> int:
        self.send("QUIT")
        return self.proc.wait(timeout=TIMEOUT)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    from tools import make_moe
    d = tmp_path_factory.mktemp("hybrids")
    for preset in HYBRIDS:
        assert make_moe.main(["--preset", preset, "--out", str(d / f"{preset}.gguf")]) == 0
    return d


@pytest.fixture
def llama_model(fixtures_dir):
    return fixtures_dir / "reference" / MODEL


@pytest.fixture(params=sorted(ARCH))
def model(request, fixtures_dir):
    skip_unless_backend_runs(request.param)
    if request.param in HYBRIDS:
        return request.getfixturevalue("hybrid_models") / f"{request.param}.gguf"
    return fixtures_dir / "reference" / f"{request.param}.gguf"


@pytest.fixture
def worker(model):
    # --ctx 2048: the llama model's own context, which the error messages below name
    w = Worker(model, "--ctx", "2048")
    yield w
    w.kill()


def gen(max_new, prompt, **params):
    return protocol.format_gen(protocol.GenRequest(max_new, list(prompt), params))


def tokens(lines):
    return [int(l.split()[1]) for l in lines if l.startswith("T ")]


def shape(lines):
    # The protocol's order for one request, as a string of message kinds.
    return " ".join(protocol.kind(l) for l in lines)


PROMPT = [1021, 1022, 87, 301, 45, 600, 12, 999, 250, 77, 31, 402, 5, 18, 700, 66, 90]


def test_ready_info_and_one_request_in_order(worker, model):
    from engine.tokenizer import Tokenizer
    assert worker.ready == f"READY {worker.info['ctx']} stop"
    assert worker.info["backend"] == BACKEND and worker.info["arch"] == ARCH[model.stem]
    eog = {int(i) for i in worker.info["eog"].split(",")}
    assert 1023 in eog  # <|im_end|>, CONTROL in the tiny vocabulary
    assert eog == Tokenizer.from_gguf(model).eog_ids   # the worker stops where the server's text ends
    lines = worker.request(gen(6, PROMPT))
    assert re.fullmatch(r"RESUME( PP)+ REUSED( T)* DONE", shape(lines)), lines
    assert lines[0] == "RESUME 0"
    pps = [protocol.parse_pp(l) for l in lines if l.startswith("PP")]
    assert pps[-1][:2] == (len(PROMPT), len(PROMPT))
    done = protocol.parse_done(lines[-1])
    assert len(lines[-1].split()) == 15
    assert done.prompt == len(PROMPT) and done.prompt_read == len(PROMPT) and done.reused == 0
    assert done.generated == len(tokens(lines))
    assert (done.finish, done.generated) == ("length", 6) or done.finish == "stop"
    assert worker.quit() == 0


@pytest.fixture(params=["tiny-llama-legacy.gguf", "tiny-qwen3moe-q4k.gguf", *HYBRIDS])
def any_worker(request, fixtures_dir):
    skip_unless_backend_runs(request.param)
    if request.param in HYBRIDS:
        path = request.getfixturevalue("hybrid_models") / f"{request.param}.gguf"
    else:
        path = fixtures_dir / "reference" / request.param
    w = Worker(path, "--prompt-chunk", "5")
    yield w
    w.kill()


def test_prefix_reuse_matches_a_cold_run(any_worker):
    worker = any_worker
    first = worker.request(gen(5, PROMPT))
    follow = PROMPT + tokens(first) + [400, 401, 402]
    warm = worker.request(gen(8, follow))
    warm_done = protocol.parse_done(warm[-1])
    assert warm[0] == f"RESUME {warm_done.reused}" and warm_done.reused > 0
    assert warm_done.prompt_read == len(follow) - warm_done.reused
    # a different first token makes the worker read everything again: a cold run in the same process
    worker.request(gen(2, [3, 4, 5]))
    cold = worker.request(gen(8, follow))
    assert cold[0] == "RESUME 0"
    assert tokens(warm) == tokens(cold)


def _lines_to_done(w, line, until=("DONE", "ERR")):
    # like Worker.request, but keeping INFO lines: a recurrent model's checkpoint count comes just before DONE (the
    # CUDA backend's CACHE line after each DONE is skipped, as Worker.request does); line None: read only
    if line is not None:
        w.send(line)
    out = []
    while not out or not out[-1].startswith(until):
        line = w.read()
        if protocol.kind(line) != "CACHE":
            out.append(line)
    return out


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_second_turn_resumes_from_a_checkpoint_like_a_cold_run(hybrid_models, name):
    skip_unless_backend_runs(name)
    model = hybrid_models / f"{name}.gguf"
    long_prompt = [(i * 37 + 11) % 1000 for i in range(70)]
    w = Worker(model, "--prompt-chunk", "8", "--checkpoint-every", "32")
    cold = Worker(model, "--prompt-chunk", "8")
    try:
        first = _lines_to_done(w, gen(5, long_prompt))
        info = protocol.parse_info(first[-2])
        # checkpoints at 32, 64, 70 - 16 = 54 and at the request's end
        assert first[-2].startswith("INFO ") and info["checkpoints"] == "4" and float(info["checkpoint_mib"]) > 0
        # The next request re-renders the end of the last prompt (as Qwen3.5's template drops <think>). It diverges
        # just past a checkpoint, so only a few tokens are read again: a wrong state would still show in the logits.
        follow = long_prompt[:56] + [5, 6]
        warm = _lines_to_done(w, gen(6, follow))
        done = protocol.parse_done(warm[-1])
        assert warm[0] == "RESUME 54" and done.reused == 54 and done.prompt_read == len(follow) - 54
        assert tokens(warm) == tokens(cold.request(gen(6, follow)))
        # an edit further back resumes from an earlier checkpoint
        edited = long_prompt[:33] + [9, 9] + long_prompt[35:]
        again = w.request(gen(4, edited))
        assert again[0] == "RESUME 32" and tokens(again) == tokens(cold.request(gen(4, edited)))
        # STOP mid-prompt, then a new GEN that diverges inside what was read
        w.send(gen(4, list(range(300, 700))))
        assert _lines_to_done(w, None, until=("RESUME",)) == ["RESUME 0"]
        w.send("STOP")
        stopped = protocol.parse_done(w.collect()[-1])
        assert stopped.finish == "cancel" and stopped.prompt_read < 400
        after = list(range(300, 340)) + [1, 2, 3]
        lines = w.request(gen(4, after))
        assert protocol.parse_done(lines[-1]).reused <= 40
        assert tokens(lines) == tokens(cold.request(gen(4, after)))
    finally:
        w.kill()
        cold.kill()


def test_qwen4exp_info_before_done_counts_the_n_gram_rows(hybrid_models):
    skip_unless_backend_runs("tiny-qwen4exp")
    # the PLE table is read by rows through a bounded cache: each request's INFO says how often it hit
    w = Worker(hybrid_models / "tiny-qwen4exp.gguf", "--prompt-chunk", "8")
    try:
        assert int(w.info["ple_row_cache_mib"]) > 0
        first = _lines_to_done(w, gen(5, PROMPT))
        info = protocol.parse_info(first[-2])
        fed = len(PROMPT) + len(tokens(first)) - 1        # the last token sampled is not run
        assert int(info["ple_row_lookups"]) == 16 * fed and 0 <= int(info["ple_row_hits"]) < 16 * fed
        # another first token: read from nothing; the n-grams ending at 1022 and 87 are the first request's
        # (1021 is this vocabulary's PLE EOS, which blanks what comes before it)
        again = _lines_to_done(w, gen(1, [2, *PROMPT[:3]]))
        assert again[0] == "RESUME 0"
        info = protocol.parse_info(again[-2])
        assert int(info["ple_row_lookups"]) == 16 * 4 and int(info["ple_row_hits"]) >= 16 * 2
    finally:
        w.kill()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_hybrid_greedy_tokens_after_a_checkpoint_resume_follow_llama_cpp(tmp_path, arch):
    """The F16 references of tests/fixtures/hybrid (llama.cpp's greedy run, equal to ours at every step) through the
    worker, after a request that diverges from the reference prompt: the worker resumes from a checkpoint inside
    the prompt and still gives llama.cpp's ids."""
    import hashlib
    import json
    from tools import make_moe
    ref = json.loads((ROOT / "tests" / "fixtures" / "hybrid" / f"tiny-{arch}-f16.json").read_text())
    # the fixture names the make_moe command its model was written by
    assert ref["source"][0] == "python -m tools.make_moe"
    path = tmp_path / f"tiny-{arch}-f16.gguf"
    assert make_moe.main([*ref["source"][1:], "--out", str(path)]) == 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["model_sha256"]
    case = max(ref["cases"], key=lambda c: len(c["prompt_ids"]))
    prompt = case["prompt_ids"]
    w = Worker(path, "--prompt-chunk", "7", "--checkpoint-every", "64")
    try:
        eog = {int(x) for x in w.info["eog"].split(",")}
        other = prompt[:200] + [(prompt[200] + 1) % 1000] * 10       # checkpoints 64, 128, 192, 210 - 16, 210
        w.request(gen(1, other))
        lines = w.request(gen(len(case["greedy_ids"]), prompt))
        assert lines[0] == "RESUME 194"
        expect = []
        for t in case["greedy_ids"]:
            if t in eog:
                break
            expect.append(t)
        assert len(expect) >= 4 and tokens(lines) == expect
    finally:
        w.kill()


def test_stop_mid_prompt_cancels_and_the_worker_keeps_serving(model):
    w = Worker(model, "--prompt-chunk", "2")
    try:
        long_prompt = [(i * 37 + 11) % 1000 for i in range(1000)]
        w.send(gen(4, long_prompt))
        assert w.read() == "RESUME 0"
        assert w.read().startswith("PP 2 1000 ")
        w.send("STOP")
        lines = w.collect()
        done = protocol.parse_done(lines[-1])
        assert done.finish == "cancel" and 0 < done.prompt_read < len(long_prompt) and done.generated == 0
        assert "T" not in shape(lines)
        # What was read stays cached; a STOP between requests is ignored.
        w.send("STOP")
        again = w.request(gen(3, long_prompt[:600]))
        d2 = protocol.parse_done(again[-1])
        assert d2.finish in ("length", "stop") and d2.reused == min(done.prompt_read, 599)
        assert w.quit() == 0
    finally:
        w.kill()


def test_stop_mid_decode_cancels(worker):
    worker.send(gen(1500, [1, 2, 3]))
    while not worker.read().startswith("T "):
        pass
    worker.send("STOP")
    lines = worker.collect()
    done = protocol.parse_done(lines[-1])
    assert done.finish in ("cancel", "stop") and done.generated < 1500


@pytest.mark.parametrize("line,needle", [
    ("GEN five 1,2,3", "max_new"),
    ("GEN 4 1,two,3", "comma-separated token ids"),
    ("GEN 4 temprature=0.5 1,2,3", "unknown key 'temprature'"),
    ("GEN 4 top_p=2 1,2,3", "top_p"),
    ("GEN 4 1,2,1024", "outside this model's vocabulary (0..1023)"),
    ("GEN 4 -3", "outside"),
    ("GEN 2040 1,2,3", "exceeds the context of 2048: lower max_new to 2037"),
    ("HELLO", "expected GEN, STOP or QUIT"),
])
def test_errors_are_one_err_line_and_the_worker_keeps_serving(worker, line, needle):
    lines = worker.request(line) if line.startswith("GEN") else (worker.send(line) or [worker.read()])
    assert len(lines) == 1 and lines[0].startswith("ERR ") and needle in lines[0], lines
    ok = worker.request(gen(2, [5, 6, 7]))
    assert protocol.parse_done(ok[-1]).finish in ("length", "stop")


def test_context_limit_counts_prompt_max_new_and_margin(model):
    w = Worker(model, "--ctx", "64")
    try:
        assert w.ready == "READY 64 stop"
        assert w.request(gen(6, list(range(50))))[-1].startswith("DONE")   # 50 + 6 + 8 = 64
        err = w.request(gen(7, list(range(50))))                           # 65
        assert err[0].startswith("ERR prompt 50 + max_new 7 + 8 = 65 tokens exceeds the context of 64")
        assert "--ctx" in err[0]
    finally:
        w.kill()


def test_max_new_zero_reads_the_prompt_only(worker):
    lines = worker.request(gen(0, PROMPT))
    assert re.fullmatch(r"RESUME( PP)+ REUSED DONE", shape(lines))
    d = protocol.parse_done(lines[-1])
    assert (d.generated, d.finish, d.prompt_read) == (0, "length", len(PROMPT))


def test_seeded_sampling_is_reproducible(worker):
    a = worker.request(gen(12, PROMPT, temperature=1.5, top_k=50, seed=7))
    b = worker.request(gen(12, PROMPT, temperature=1.5, top_k=50, seed=7))
    greedy = worker.request(gen(12, PROMPT))
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(greedy) or len(tokens(a)) < 3


def test_end_of_stdin_exits_zero_after_answering(model):
    p = subprocess.run([*WORKER, "--model", str(model), "--backend", BACKEND], input=gen(3, PROMPT) + "\n",
                       capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert all(protocol.kind(l) for l in out), out  # stdout carries protocol lines only
    assert [l for l in out if protocol.kind(l) != "CACHE"][-1].startswith("DONE")     # CUDA: a CACHE line follows


def _one_clear_line(p):
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, err
    assert p.stdout == ""
    return err[0]


def _start(model_path, *flags):
    return subprocess.run([*WORKER, "--model", str(model_path), "--backend", BACKEND, *flags], input="",
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)


def test_truncated_gguf(llama_model, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = llama_model.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    assert "truncated" in _one_clear_line(_start(bad))


def test_text_file_named_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are not weights\n")
    assert "not a GGUF file" in _one_clear_line(_start(bad))


def test_unknown_architecture(llama_model, tmp_path):
    data = bytearray(llama_model.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key)
    vtype, n = struct.unpack_from("<IQ", data, at)
    assert (vtype, bytes(data[at + 12: at + 12 + n])) == (8, b"llama")
    data[at + 12: at + 12 + n] = b"zlama"  # same length: the rest of the file stays valid
    bad = tmp_path / "zlama.gguf"
    bad.write_bytes(bytes(data))
    line = _one_clear_line(_start(bad))
    assert "zlama" in line and "llama" in line.split("zlama", 1)[1]  # names it and lists the supported ones


def test_missing_model_and_bad_flags(llama_model, tmp_path):
    assert "no model file" in _one_clear_line(_start(tmp_path / "absent.gguf"))
    assert "--no-such-flag" in _one_clear_line(_start(llama_model, "--no-such-flag"))
    assert "--ctx" in _one_clear_line(_start(llama_model, "--ctx", "0"))
    assert "--prompt-chunk" in _one_clear_line(_start(llama_model, "--prompt-chunk", "0"))
    assert "--checkpoint-mib" in _one_clear_line(_start(llama_model, "--checkpoint-mib", "-1"))


@pytest.mark.parametrize("name", ["tiny-llama-legacy", "tiny-llama-kquants", "tiny-qwen3moe-q4k",
                                  "tiny-qwen2moe-mixed"])
def test_worker_greedy_tokens_follow_llama_cpp(fixtures_dir, name):
    """End to end through the protocol: llama.cpp's greedy ids, up to its first unclear step or end of turn."""
    import json
    ref = json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())
    clear = ref["tolerance"]["top1_equal_where_margin_at_least"]
    w = Worker(fixtures_dir / "reference" / f"{name}.gguf", "--prompt-chunk", "3")
    try:
        eog = {int(x) for x in w.info["eog"].split(",")}

        def comparable(case):
            out = []
            for tok, step in zip(case["greedy_ids"], case["steps"]):
                if step["margin"] < clear or tok in eog:
                    break
                out.append(tok)
            return out
        # the case whose clear prefix is longest, so the comparison is never vacuous
        case = max(ref["cases"], key=lambda c: len(comparable(c)))
        expect = comparable(case)
        assert len(expect) >= 2
        lines = w.request(gen(len(case["greedy_ids"]), case["prompt_ids"]))
        assert tokens(lines)[: len(expect)] == expect
        assert protocol.parse_done(lines[-1]).prompt_read == len(case["prompt_ids"])
    finally:
        w.kill()


def test_calibrate_times_a_prompt_and_a_decode_then_exits(model):
    import shlex
    p = subprocess.run([*WORKER, "--model", str(model), "--backend", "cpu", "--ctx", "64", "--calibrate"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("CALIBRATE ")]
    assert len(lines) == 1 and not any(l.startswith("READY") for l in p.stdout.splitlines())
    facts = dict(t.split("=", 1) for t in shlex.split(lines[0][len("CALIBRATE "):]))
    # ctx 64: (64 - 8) // 4 = 14 new tokens after a prompt of 64 - 8 - 14 - 1 = 41
    assert (int(facts["calib_prompt_tokens"]), int(facts["calib_decode_tokens"])) == (41, 14)
    assert float(facts["prompt_tok_s"]) > 0 and float(facts["decode_tok_s"]) > 0


def test_sigterm_closes_the_backend_and_exits_cleanly(worker):
    import signal
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=TIMEOUT) == 143
    time.sleep(0.2)  # let the stderr pump catch the last lines
    assert "Fatal Python error" not in "".join(worker.stderr) and "Traceback" not in "".join(worker.stderr)


# The real worker with CPUBackend.forward patched to fail: the first call raises `exc`, later calls work.
FAILING_WORKER = """
import sys
sys.path.insert(0, {root!r})
import engine.backend_cpu as b
from engine.session import BackendBroken
real, calls = b.CPUBackend.forward, []
def forward(self, *a, **k):
    calls.append(1)
    if len(calls) == 1:
        raise {exc}
    return real(self, *a, **k)
b.CPUBackend.forward = forward
import strata_worker
sys.exit(strata_worker.main())
"""


def _failing(model, exc):
    return subprocess.Popen([sys.executable, "-c", FAILING_WORKER.format(root=str(ROOT), exc=exc), "--model",
                             str(model), "--backend", "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_a_failure_inside_a_request_is_an_err_and_the_worker_keeps_serving(model):
    p = _failing(model, "MemoryError('scratch buffer')")
    out, err = p.communicate(gen(3, PROMPT) + "\n" + gen(3, PROMPT) + "\n", timeout=TIMEOUT)
    lines = [l for l in out.splitlines() if protocol.kind(l) not in ("INFO", "READY")]
    assert lines[0] == "RESUME 0" and lines[1] == "ERR request failed: MemoryError: scratch buffer"
    assert lines[-1].startswith("DONE") and p.returncode == 0


def test_a_broken_backend_errs_then_exits_nonzero_with_the_reason(model):
    p = _failing(model, "BackendBroken('device lost')")
    out, err = p.communicate(gen(3, PROMPT) + "\n" + gen(3, PROMPT) + "\n", timeout=TIMEOUT)
    assert out.splitlines()[-1] == "ERR the engine failed and must restart: device lost"
    assert p.returncode == 1 and "device lost" in err.strip().splitlines()[-1]


CACHE_WORKER = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
import engine.backend_cpu as b
b.CPUBackend.cache_picture = lambda self: (2, 5, np.eye(2, 5, dtype=bool), np.arange(10, dtype=np.uint8) * 25)
import strata_worker
sys.exit(strata_worker.main())
"""


def test_a_backend_with_an_expert_cache_reports_it_after_each_done(model):
    p = subprocess.run([sys.executable, "-c", CACHE_WORKER.format(root=str(ROOT)), "--model", str(model),
                        "--backend", "cpu"], input=gen(2, PROMPT) + "\n", capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    out = p.stdout.splitlines()
    assert p.returncode == 0 and out[-2].startswith("DONE") and out[-1].startswith("CACHE ")
    n_layer, n_expert, resident, heat = protocol.parse_cache(out[-1])
    assert (n_layer, n_expert) == (2, 5) and (resident == np.eye(2, 5, dtype=bool)).all()
    assert heat.ravel().tolist() == [i * 25 for i in range(10)]
