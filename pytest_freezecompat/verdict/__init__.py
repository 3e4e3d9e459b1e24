"""Verdicts: pure functions of what the ranks saw; imports no process code."""
