"""The `serve` section of params.yaml: how `loupe serve` runs a trained model behind its HTTP API."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from loupe.config import Section


class ServeParams(Section):
    """`loupe serve`'s settings; the model's protocol, crop tool and engine come from `protocol` and `rollout`."""

    # A key pasted into `api_key_env` by mistake must not be echoed back in the validation error.
    model_config = ConfigDict(hide_input_in_errors=True)

    host: str = "127.0.0.1"
    """Address to listen on; 0.0.0.0 reaches it from other machines (set an API key first)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (printed at start)."""
    model_name: str | None = None
    """The model's id in /v1/models and in replies; None: the model directory's name."""
    api_key_env: str | None = Field("LOUPE_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable holding the key clients must send (`Authorization: Bearer KEY`). Unset or empty, the
    server answers anyone who reaches it, and says so at start; the key itself is never logged."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of every turn; 0 is greedy (the same question gets the same search). One value for
    the server, because requests share the engine's batch; a request asking for another is refused."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass, like `temperature` one value for the server."""
    max_turns: int | None = Field(None, ge=1)
    """Assistant turns per request at most; None keeps protocol.max_turns."""
    max_new_tokens: int | None = Field(None, ge=1)
    """New tokens per assistant turn at most; None keeps rollout.max_new_tokens. A request's `max_tokens` can
    lower it, not raise it."""
    max_running: int | None = Field(None, ge=1)
    """Requests searching at once, their turns sharing the engine's running batch; None: rollout.batch_size."""
    max_queued: int = Field(64, ge=0)
    """Requests waiting for a running slot at most; one more is answered 503 with Retry-After."""
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest request body (base64 images included); a larger one is answered 413 before it is read whole."""
    max_images_per_request: int = Field(4, ge=1)
    """Images one request may carry (the question's; its crops come on top, up to protocol.max_images)."""
    max_image_pixels: int = Field(40_000_000, ge=1)
    """Largest image, width x height, read from its header before it is decoded: a decompression bomb is refused
    without being unpacked."""
    min_image_side: int = Field(8, ge=1)
    """Smallest width or height accepted: thinner images cannot be cropped or patched."""
    fetch_image_urls: bool = False
    """Whether `image_url`s may be http(s) addresses the server downloads (at most max_request_bytes each, with
    `fetch_timeout_s`); off, only data URLs are taken, so the server never reaches out on a client's behalf."""
    fetch_timeout_s: float = Field(10.0, gt=0)
    """Seconds one image download may take, when `fetch_image_urls` is on."""
