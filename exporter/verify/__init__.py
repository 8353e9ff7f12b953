"""Verify: what a package must satisfy (post-conditions at export, ``check`` after it, against the EP
and against transformers) and the measures it uses."""
