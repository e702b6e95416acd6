"""`ling-jax serve`: an OpenAI-compatible HTTP server over `ling_jax.serve.Engine` (README, "Serve").

| module | job |
|---|---|
| `protocol.py` | request / response bodies (pydantic) |
| `requests.py` | request body -> prompt ids and `RequestParams` per choice (checks needing the model) |
| `text.py` | incremental detokeniser, stop-string matcher |
| `driver.py` | the thread that owns the engine; the bounded queue |
| `generation.py` | one request's choices on the engine -> text deltas |
| `app.py` | the FastAPI app: module-level routes (an APIRouter over `app.state`), one streaming helper |
| `errors.py` | OpenAI error JSON for every refusal |
| `metrics.py` | Prometheus metrics |
| `runner.py` | uvicorn: `start_server` (background thread), sockets |
"""
from ling_jax.server.runner import ServerThread, start_server  # noqa: F401

__all__ = ["ServerThread", "start_server"]
