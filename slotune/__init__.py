"""slotune: a declarative serving-optimization autotuner and operator for LLM inference."""
