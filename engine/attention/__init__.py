"""Attention over the block pool: one step's rows and batch (`step_row.py`,
`step_batch.py`), paged attention registered with transformers (`paged.py`), eager order for
softcapped and sink layers (`eager.py`), a `Cache` over the pool for models that bring their
own attention (`step_cache.py`), and a lone decoding request's contiguous K/V
(`decode_mirror.py`)."""
