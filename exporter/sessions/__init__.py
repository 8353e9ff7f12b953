"""The ONNX sessions a package holds, each one module: what to trace, its I/O names, its
genai_config section. The export plan lists the sessions that apply; the pipeline runs the same
steps for each. Today one: the text decoder."""

from exporter.sessions.decoder import DecoderSession

# In package order. A new session is one module plus one line here.
SESSIONS = {s.name: s for s in (DecoderSession(),)}

__all__ = ["SESSIONS", "DecoderSession"]
