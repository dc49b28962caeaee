"""Speculative decoding's figures through the server: DONE's drafts fields summed per request and in the totals,
/metrics (JSON and Prometheus) and the Monitor's inputs, with the real worker (`--draft ngram`, CPU backend) on a
tiny model, and the derived figures (server/service.py speculation) by themselves."""
import sys

import pytest
import requests

from fakes.server_kit import ROOT, metrics, running_server
from server.metrics import prometheus
from server.service import speculation

MODEL = "tiny-qwen3moe-q4k.gguf"


def test_speculation_figures():
    assert speculation(dict(generated=10, drafts_offered=0, drafts_accepted=0)) == \
        dict(draft_acceptance=None, tokens_per_window=None)
    # 30 tokens, 18 of them confirmed drafts: 12 windows of 2.5 tokens
    assert speculation(dict(generated=30, drafts_offered=24, drafts_accepted=18)) == \
        dict(draft_acceptance=0.75, tokens_per_window=2.5)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, fixtures_dir):
    from server.config import validate
    from server.text import TextCodec
    model = fixtures_dir / "reference" / MODEL
    tmp = tmp_path_factory.mktemp("spec_server")
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "512", "--draft", "ngram", "--draft-fixed"], port=0,
                        log=str(tmp / "worker.log"), engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (httpd, base):
        yield httpd, base


def test_the_worker_reports_drafts_and_the_server_shows_them(spec_server):
    httpd, base = spec_server
    # the tiny random model's greedy answers fall into loops, which the n-gram drafter follows
    r = requests.post(base + "/v1/completions", timeout=120,
                      json=dict(prompt="a b c a b c a b c", max_tokens=60, temperature=0))
    assert r.status_code == 200, r.text
    m = metrics(base)
    t = m["totals"]
    assert m["worker"]["info"]["draft"] == "ngram"
    assert 0 < t["drafts_accepted"] <= t["drafts_offered"]
    assert t["draft_acceptance"] == round(t["drafts_accepted"] / t["drafts_offered"], 4)
    assert t["tokens_per_window"] > 1.0
    h = m["history"][-1]
    assert h["drafts_offered"] == t["drafts_offered"] and h["drafts_accepted"] == t["drafts_accepted"]
    text = requests.get(base + "/metrics?format=prometheus", timeout=30).text
    assert f'strata_drafts_offered_total{{model="{m["model"]}"}} {t["drafts_offered"]}' in text
    assert f'strata_drafts_accepted_total{{model="{m["model"]}"}} {t["drafts_accepted"]}' in text
    assert "# TYPE strata_draft_acceptance gauge" in text and "# TYPE strata_tokens_per_window gauge" in text


def test_prometheus_without_drafts_has_no_derived_gauges():
    snap = dict(model="m", totals=dict(stop=0, length=0, cancel=0, error=0, prompt_tokens=0, prompt_read=0,
                                       cached_tokens=0, generated=0, prompt_ms=0.0, decode_ms=0.0, hits=0, lookups=0,
                                       ram_blobs=0, file_blobs=0, file_mb=0.0, drafts_offered=0, drafts_accepted=0,
                                       draft_acceptance=None, tokens_per_window=None),
                queue=dict(waiting=0, running=None), tok_s=0.0, worker=dict(alive=False, starts=0, failures=0))
    text = prometheus(snap)
    assert 'strata_drafts_offered_total{model="m"} 0' in text and "strata_draft_acceptance" not in text
