"""Drafters: one module per speculative technique, registered under the spekula.drafters entry-point group."""
