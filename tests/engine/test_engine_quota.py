"""Per-tenant device-block quota through the engine."""

from engine_helpers import micro_cache_config

from engine.loop.engine import Engine, SamplingParams


def test_a_tenant_at_its_quota_caches_no_more_while_another_tenant_still_can(micro):
    params = SamplingParams(max_new_tokens=2)
    prompt = list(range(10, 51))  # 41 tokens + 2 generated: KV for 42 tokens = 10 blocks of 4
    with Engine(micro, micro_cache_config(tenant_quota_blocks=5)) as eng:
        eng.submit(prompt, params, tenant="x").result()
        assert eng.submit(prompt, params, tenant="x").result().cached_tokens == 20  # 5 blocks
        # no salts here, so y reads x's 5 blocks; the next 5 count against y's own quota
        assert eng.submit(prompt, params, tenant="y").result().cached_tokens == 20
        # y's first request committed all 10 blocks and kept its tail (positions 40, 41):
        # the prompt's 41st token comes from it
        assert eng.submit(prompt, params, tenant="y").result().cached_tokens == 41
        eng.cache.check_integrity()
