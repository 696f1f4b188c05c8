"""The HTTP API layer that the replica server (`engine.server`) and the router
(`engine.router`) share. It imports neither torch nor the engine, so a router stays light.

Parts every API shape uses:
- `errors`: ApiError and the app's error handlers; `body`: reading a JSON body;
- `keys`: the API keys configured (flags, keys file, environment);
- `auth`: Bearer keys -> tenants -> cache salts; `sse`: event streams and their closing;
- `prompts`: a request's prompt rendered to token ids, as the replicas render it.

OpenAI's shape: `openai` (request bodies), `openai_responses` (answers and stream chunks),
`routes` (its POST routes). Another API shape sits beside these as modules of its own.
"""
