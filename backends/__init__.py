"""Backends: model runtimes implementing spekula.core.backend.Backend, loaded by name."""
