"""The OpenAI API: one folder per endpoint, and what they share (protocol, errors, pipeline)."""
