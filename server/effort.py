"""How hard the model should think, from a request, as the chat template's `reasoning_effort` variable.

OpenAI's chat completions take a top-level `reasoning_effort`; Anthropic's messages take `output_config.effort` (and
here a top-level `reasoning_effort` too). gpt-oss's template writes it into the system message ("Reasoning: high");
templates that do not read the variable ignore it. An explicit `chat_template_kwargs.reasoning_effort` wins.
"""
from __future__ import annotations

from server.schema import ApiError

EFFORTS = ("low", "medium", "high")


def effort_kwargs(body: dict, anthropic: bool = False) -> dict:
    """{"reasoning_effort": ...} when the request names one, else {}; a value gpt-oss does not know is a 400."""
    value, param = body.get("reasoning_effort"), "reasoning_effort"
    if anthropic and value is None:
        oc = body.get("output_config")
        if oc is not None and not isinstance(oc, dict):
            raise ApiError(400, "'output_config' must be an object", param="output_config")
        value, param = (oc or {}).get("effort"), "output_config.effort"
    if value is None:
        return {}
    if value not in EFFORTS:
        raise ApiError(400, f"'{param}' must be one of {', '.join(EFFORTS)}, not {str(value)[:40]!r}", param=param)
    return {"reasoning_effort": value}
