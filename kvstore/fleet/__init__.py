"""What a fleet of replicas sees of a cache: its block events in vLLM's shapes
(`events.py`) and the routing cost shared by `kvstore router` and the replay (`routing.py`)."""
