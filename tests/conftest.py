"""Shared fixtures: a tiny tokenizer, corpus and target that the suite builds once per session."""
