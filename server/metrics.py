"""/metrics in Prometheus' text format, from the same snapshot the JSON form shows."""
from __future__ import annotations


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def prometheus(snap: dict) -> str:
    t = snap["totals"]
    model = _esc(snap["model"])
    lines = []

    def metric(name, kind, help_, value, labels=""):
        lines.append(f"# HELP strata_{name} {help_}")
        lines.append(f"# TYPE strata_{name} {kind}")
        lines.append(f"strata_{name}{{model=\"{model}\"{labels}}} {value}")

    lines.append("# HELP strata_requests_total Finished requests by how they ended.")
    lines.append("# TYPE strata_requests_total counter")
    for finish in ("stop", "length", "cancel", "error"):
        lines.append(f"strata_requests_total{{model=\"{model}\",finish=\"{finish}\"}} {t[finish]}")
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", t["prompt_tokens"])
    metric("prompt_read_tokens_total", "counter", "Prompt tokens actually read (not reused, not cut by a STOP).",
           t["prompt_read"])
    metric("cached_tokens_total", "counter", "Prompt tokens reused from the worker's cache.", t["cached_tokens"])
    metric("generated_tokens_total", "counter", "Generated tokens.", t["generated"])
    metric("prompt_seconds_total", "counter", "Time spent reading prompts.", round(t["prompt_ms"] / 1000, 3))
    metric("decode_seconds_total", "counter", "Time spent generating.", round(t["decode_ms"] / 1000, 3))
    metric("expert_cache_hits_total", "counter", "Expert-cache hits while decoding.", t["hits"])
    metric("expert_cache_lookups_total", "counter", "Expert-cache look-ups while decoding.", t["lookups"])
    metric("expert_ram_reads_total", "counter", "Experts read from pinned RAM over PCIe (decode misses).",
           t["ram_blobs"])
    metric("expert_file_reads_total", "counter", "Experts read from the model file (--mmap-experts or "
           "--resident-budget-gib).", t["file_blobs"])
    metric("expert_file_read_megabytes_total", "counter", "MB of experts read from the model file.",
           round(t["file_mb"], 1))
    metric("drafts_offered_total", "counter", "Draft tokens verify windows checked (speculative decoding, --draft).",
           t["drafts_offered"])
    metric("drafts_accepted_total", "counter", "Draft tokens the model confirmed.", t["drafts_accepted"])
    if t.get("draft_acceptance") is not None:
        metric("draft_acceptance", "gauge", "Drafts accepted over drafts offered, since the start.",
               t["draft_acceptance"])
    if t.get("tokens_per_window") is not None:
        metric("tokens_per_window", "gauge", "Generated tokens per decode window (1 without speculation).",
               t["tokens_per_window"])
    metric("queue_waiting", "gauge", "Requests waiting for the engine.", snap["queue"]["waiting"])
    metric("requests_running", "gauge", "Requests the engine is running (0 or 1).",
           int(snap["queue"]["running"] is not None))
    metric("tokens_per_second", "gauge", "Generated tokens per second over the last 2 s.", snap["tok_s"])
    metric("worker_up", "gauge", "1 while the worker process runs.", int(snap["worker"]["alive"]))
    metric("worker_starts_total", "counter", "Worker starts.", snap["worker"]["starts"])
    metric("worker_failures_total", "counter", "Worker failures (exits, silence, failed starts).",
           snap["worker"]["failures"])
    return "\n".join(lines) + "\n"
