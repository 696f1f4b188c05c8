"""OpenAI-compatible HTTP server over the engine: `kvstore serve`.

- `config`: ServerConfig and the server's flags (standard library only);
- `auth`: Bearer keys -> tenants -> cache salts;
- the engine itself (engine.scheduler) queues requests fairly per tenant, bounded (429 when full);
- `protocol`: request validation and response objects; `streaming`: SSE;
- `metrics`: the Prometheus page; `service`: the request path; `app`: routes and `run_server`.

The FastAPI parts are imported lazily: `from engine.server.app import create_app`.
"""
