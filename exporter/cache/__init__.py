"""Cache: the graph cache (reused lowered graphs) and replays (a re-export that only re-reads weights)."""
