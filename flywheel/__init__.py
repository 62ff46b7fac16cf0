"""agent-flywheel: train LLM agents on their own experience, round after round."""

__version__ = "0.1.0"
