"""Log-probabilities in OpenAI's two shapes, from the service's ("logprobs", id, logprob, [(id, logprob), ...]) events.

The worker computes them beside the sampler (engine/sampling.py logprobs_of; the GPU's top_logprobs kernel): the
model's distribution after a grammar mask, before penalties, temperature and the top-k/p cuts, so at temperature 0
the top entry is the sampled token.
"""
from __future__ import annotations


def _token(tok, i: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(i, special=True)
    return b.decode("utf-8", "replace"), list(b)


def chat_content(tok, events: list) -> list[dict]:
    """Chat completions' logprobs.content entries."""
    out = []
    for _, i, lp, top in events:
        text, raw = _token(tok, i)
        alts = []
        for j, v in top:
            t2, b2 = _token(tok, j)
            alts.append({"token": t2, "logprob": v, "bytes": b2})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return out


def completion_logprobs(tok, events: list, offset: int = 0) -> dict:
    """Legacy completions' logprobs: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for _, i, lp, top in events:
        text, _ = _token(tok, i)
        tokens.append(text)
        lps.append(lp)
        tops.append({_token(tok, j)[0]: v for j, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
