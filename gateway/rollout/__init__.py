"""A guarded progressive rollout from a baseline arm to a candidate (docs/rollout.md)."""
