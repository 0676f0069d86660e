"""Drafters that need no model: the n-gram family and suffix decoding."""
