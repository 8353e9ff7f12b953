"""Weights: read from their source one tensor at a time, never all in memory (meta-device models,
placeholders in the graph, lazy initializers and the steps that derive them)."""
