"""Constrained outputs: the output plan, response formats, tool calls and their parser."""
