"""OpenAI- and Anthropic-compatible HTTP server over the engine: `kvstore serve`.

- `config`: ServerConfig and the server's flags (standard library only);
- the HTTP layer it shares with the router (`engine.api`): request bodies, auth and salts,
  errors, SSE, prompt rendering and the OpenAI routes;
- the engine itself (engine.loop.scheduler) queues requests fairly per tenant, bounded
  (429 when full);
- `streaming`: tokens to text deltas; `metrics`: the Prometheus page;
- `service`: the request path; `app`: routes and `run_server`.

The FastAPI parts are imported lazily: `from engine.server.app import create_app`.
"""
