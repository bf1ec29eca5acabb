"""`rm_type: remote_rm`: score a sample by POSTing it to a reward-model server at `rm_url`.

Payload, as in slime: `{"prompt": ..., "response": ..., "label": ...}`; the server answers with a
JSON number (the reward) or a JSON object (a dict reward, picked with `reward_key`). Requests go
through `EngineClient`, so connection failures, 429 and 5xx are retried with backoff and a final
failure raises `EngineHTTPError` naming the URL and the HTTP status.
"""

from __future__ import annotations

from typing import Any

from slime.engines.client import EngineClient
from slime.errors import ConfigError
from slime.types import Sample

# A reward model may be a large LLM judge: give it time, and retry transient failures a few times.
RM_TIMEOUT_S = 120.0
RM_MAX_RETRIES = 3


def make_rm_client() -> EngineClient:
    """The HTTP client remote rewards use; one per event loop, closed by whoever made it."""
    return EngineClient(timeout_s=RM_TIMEOUT_S, max_retries=RM_MAX_RETRIES)


def payload(sample: Sample) -> dict[str, Any]:
    """The JSON body slime's remote_rm sends."""
    return {"prompt": sample.prompt, "response": sample.response, "label": sample.label}


async def remote_reward(args: Any, sample: Sample, client: EngineClient) -> Any:
    """POST the sample to `args.rm_url`; the decoded JSON answer."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ConfigError("rm_type remote_rm needs rm_url (--rm-url http://host:port/path)")
    return await client.post(url, json=payload(sample))
