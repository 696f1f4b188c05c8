"""What a router and its replicas say to each other about prefill/decode disaggregation
(docs/DEPLOY.md "Prefill and decode replicas"): a replica's role, on its /health, and the
header that marks a request whose prompt a prefill replica handed over."""

ROLES = ("both", "prefill", "decode")  # `kvstore serve --role`
HANDOVER_HEADER = "x-kvstore-handover"  # its value: the prompt tokens cached before the prefill
PREFILL_REPLICA_HEADER = "x-kvstore-prefill-replica"  # on a handed-over answer: who prefilled it
