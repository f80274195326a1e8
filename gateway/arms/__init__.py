"""Deployments and their arms: local engines, upstream servers, shadow copies, weighted choice."""
