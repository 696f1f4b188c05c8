"""The device side of the cache: the block pool (`pool.py`; a hybrid model's window plane:
`hybrid_pool.py`, `window_plane.py`), the index's blocks in it (`device_index.py`), blocks a
caller holds (`held.py`), one running request's block table (`seq_blocks.py`) and finished
requests' partial last blocks (`tails.py`). The tables of running requests over the whole
cache are `kvstore/block_tables.py`."""
