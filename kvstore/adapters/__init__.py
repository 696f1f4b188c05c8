"""Adapters: vLLM, LMCache and SGLang keep their KV blocks in kvstore's spill tiers.

One module per stack, each loaded by the stack's own plug-in mechanism (docs/ADAPTERS.md):
- `kvstore.adapters.vllm.KvstoreTier`: a secondary tier of vLLM's OffloadingConnector;
- `kvstore.adapters.lmcache.KvstoreConnector`: an LMCache remote storage plugin;
- `kvstore.adapters.sglang.KvstoreHiCache`: an SGLang HiCache storage backend (`dynamic`).
All three store through `kvstore.adapters.blocks.BlockStore`. This package imports no stack:
each stack module imports its own stack.
"""
