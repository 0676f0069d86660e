"""Drafters that run a model: a smaller draft model, EAGLE-3, DFlash, DSpark and MTP heads, and the heads shipped with spekula."""
