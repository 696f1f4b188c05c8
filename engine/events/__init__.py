"""KV events on the wire: vLLM's format (`wire.py`), the replica's ZMQ publisher with replay
and snapshot (`publisher.py`) and the subscriber a router keeps per replica
(`subscriber.py`)."""
