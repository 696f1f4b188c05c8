"""`kvstore router`: the fleet's one endpoint, routing by the replicas' own KV events."""
