"""Load: where a model comes from (presets, folders, the hub, a model in memory) and what it is
(its KV-cache layout, its multimodal facts, its activation ranges), made ready to trace."""
