"""The built-in batching policies: every module here defines one (schedulers/registry.py
imports them all). Adding a built-in policy is one file here and its test."""
