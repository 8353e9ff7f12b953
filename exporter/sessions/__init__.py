"""The ONNX sessions a package holds, each one module (``exporter.sessions.base`` says what a
session is). The export plan lists the sessions that apply; the pipeline runs the same steps for
each. A text package has the decoder only; a Gemma 4 multimodal package has all four."""

from exporter.sessions.base import Session, Traced
from exporter.sessions.decoder import DecoderSession
from exporter.sessions.embedding import EmbeddingSession
from exporter.sessions.speech import SpeechSession
from exporter.sessions.vision import VisionSession

# In package order. A new session is one module plus one line here.
SESSIONS: dict[str, Session] = {s.name: s for s in (DecoderSession(), EmbeddingSession(), VisionSession(),
                                                    SpeechSession())}

__all__ = ["SESSIONS", "DecoderSession", "EmbeddingSession", "Session", "SpeechSession", "Traced", "VisionSession"]
