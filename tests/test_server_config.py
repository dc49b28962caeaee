"""strata-<model>.json: every key checked at start, with a message naming it."""
import json
import subprocess
import sys

import pytest

from server.config import ConfigError, load_config, validate

VOCAB = "vocab/tiny-bpe-1024.gguf"


def base(fixtures_dir, **kw):
    return dict(model=str(fixtures_dir / VOCAB), **kw)


def test_defaults(tmp_path, fixtures_dir):
    cfg = validate(base(fixtures_dir), tmp_path)
    assert cfg.model_name == "tiny-bpe-1024" and cfg.engine_silence_s == 300 and cfg.api_key is None
    assert cfg.log == str(tmp_path / "strata-tiny-bpe-1024.log")
    assert cfg.worker_command()[-2:] == ["--model", cfg.model]
    assert cfg.load_at_start is True and validate(base(fixtures_dir, load_at_start=False), tmp_path).load_at_start is False


@pytest.mark.parametrize("key, value", [
    ("port", "8080"), ("port", 70000), ("port", True), ("engine_silence_s", -1), ("engine_silence_s", "300"),
    ("idle_unload_s", None), ("api_key", 123), ("cors_origins", "http://a"), ("cors_origins", ["http://a/"]),
    ("worker", []), ("worker", ["python", 3]), ("args", "--ctx 8"), ("gpus", [0, "1"]), ("gpu", 1.5),
    ("sampling", {"temperature": "hot"}), ("sampling", {"top_k": 1.5}), ("reasoning_budget_tokens", 1.0),
    ("layer_split", [24, -1]), ("expert_profile_save_every", -2), ("load_at_start", "yes"), ("load_at_start", 1),
    ("load_at_start", None),
])
def test_ill_typed_values_name_the_key(tmp_path, fixtures_dir, key, value):
    with pytest.raises(ConfigError, match=key):
        validate(base(fixtures_dir, **{key: value}), tmp_path)


def test_unknown_keys_name_the_key(tmp_path, fixtures_dir):
    with pytest.raises(ConfigError, match="'prot' is unknown"):
        validate(base(fixtures_dir, prot=8080), tmp_path)
    with pytest.raises(ConfigError, match="sampling.temp"):
        validate(base(fixtures_dir, sampling={"temp": 0.7}), tmp_path)


def test_missing_model(tmp_path):
    with pytest.raises(ConfigError, match="'model' is missing"):
        validate({}, tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        validate({"model": "nowhere.gguf"}, tmp_path)


def test_worker_flags_from_config(tmp_path, fixtures_dir):
    cfg = validate(base(fixtures_dir, args=["--ctx", "2048"], expert_profile_save="p.bin",
                        expert_profile_save_every=5, gpus=[0, 1]), tmp_path)
    cmd = cfg.worker_command()
    # a relative profile path is the config folder's, like model and log (the worker runs in another cwd)
    saved = str(tmp_path / "p.bin")
    assert cmd[cmd.index("--ctx") + 1] == "2048" and cmd[cmd.index("--expert-profile-save") + 1] == saved
    assert cmd[cmd.index("--expert-profile-save-every") + 1] == "5"
    assert "--expert-profile" not in cmd          # nothing saved yet: the first start learns from scratch
    assert cfg.worker_env() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    (tmp_path / "p.bin").write_bytes(b"STRP")     # what a QUIT saved ...
    cmd = cfg.worker_command()
    assert cmd[cmd.index("--expert-profile") + 1] == saved     # ... is what the next start loads


def test_a_profile_named_in_args_wins(tmp_path, fixtures_dir):
    (tmp_path / "p.bin").write_bytes(b"STRP")
    cfg = validate(base(fixtures_dir, args=["--expert-profile", "/elsewhere.bin"], expert_profile_save="p.bin"),
                   tmp_path)
    assert cfg.worker_command().count("--expert-profile") == 1


def test_gpus_and_layer_split_reach_the_worker(tmp_path, fixtures_dir):
    cfg = validate(base(fixtures_dir, gpus=[2, 0], layer_split=[30, 18]), tmp_path)
    cmd = cfg.worker_command()
    # the worker sees exactly the config's GPUs, in its order, numbered as nvidia-smi numbers them
    assert cfg.worker_env() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}
    assert cmd[cmd.index("--gpus") + 1] == "auto" and cmd[cmd.index("--layer-split") + 1] == "30,18"
    auto = validate(base(fixtures_dir, gpus=[0, 1]), tmp_path).worker_command()
    assert "--gpus" in auto and "--layer-split" not in auto          # the worker's auto split
    one = validate(base(fixtures_dir, gpus=[1]), tmp_path)
    assert "--gpus" not in one.worker_command() and one.worker_env()["CUDA_VISIBLE_DEVICES"] == "1"
    single = validate(base(fixtures_dir, gpu=1), tmp_path)
    assert single.worker_env() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert "--gpus" not in single.worker_command()
    assert validate(base(fixtures_dir), tmp_path).worker_env() == {}


@pytest.mark.parametrize("kw, msg", [
    (dict(gpu=0, gpus=[0, 1]), r"'gpu' \(0\) and 'gpus' \(\[0, 1\]\) both choose the GPUs"),
    (dict(gpus=[]), r"'gpus': expected a list of distinct GPU indices"),
    (dict(gpus=[1, 1]), r"'gpus': expected a list of distinct GPU indices"),
    (dict(layer_split=[24, 24]), r"'layer_split' \(\[24, 24\]\) splits the layers over several GPUs: name them"),
    (dict(gpus=[0], layer_split=[48]), r"'layer_split' .*name them in 'gpus'"),
    (dict(gpus=[0, 1], layer_split=[24, 12, 12]), r"one layer count >= 1 for each of the 2 GPUs"),
    (dict(gpus=[0, 1], layer_split=[48, 0]), r"one layer count >= 1 for each of the 2 GPUs"),
    (dict(gpus=[0, 1], args=["--gpus", "0,1"]), r"'args' has --gpus and the config sets 'gpus'"),
    (dict(gpu=0, args=["--gpus=1"]), r"'args' has --gpus and the config sets 'gpu'"),
    (dict(gpus=[0, 1], layer_split=[1, 1], args=["--layer-split", "1,1"]), r"'args' has --layer-split"),
])
def test_gpu_keys_that_disagree_are_refused(tmp_path, fixtures_dir, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(base(fixtures_dir, **kw), tmp_path)


def test_bad_file_messages(tmp_path):
    p = tmp_path / "strata-x.json"
    with pytest.raises(ConfigError, match="python -m setup"):
        load_config(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(p)


def test_python_m_server_refuses_bad_config_with_one_line(tmp_path, fixtures_dir):
    p = tmp_path / "strata-x.json"
    p.write_text(json.dumps(base(fixtures_dir, engine_silence_s="soon")))
    r = subprocess.run([sys.executable, "-m", "server", "--config", str(p)], capture_output=True, text=True,
                       timeout=60, cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert r.returncode == 2 and "engine_silence_s" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_python_m_server_serves_and_quits_on_sigterm(tmp_path, fixtures_dir):
    import signal
    import socket
    import time

    import requests
    from fakes.server_kit import FAKE_WORKER, ROOT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = tmp_path / "strata-fake.json"
    p.write_text(json.dumps(base(fixtures_dir, worker=[sys.executable, str(FAKE_WORKER)], port=port,
                                 log=str(tmp_path / "w.log"))))
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(p), "--preload"], cwd=str(ROOT),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).json()["worker"]["alive"]:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.1)
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=30)
        assert r.json()["choices"][0]["text"] == "hi"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "fake worker: QUIT" in (tmp_path / "w.log").read_text()     # the worker was told to quit
        assert f"http://127.0.0.1:{port}/" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
