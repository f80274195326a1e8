"""Tiny models, fixed texts and teacher forcing shared by the tests and the scripts."""
