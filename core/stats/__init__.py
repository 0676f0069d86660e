"""Speculation statistics: llama.cpp's counters and log lines, per request and engine-wide."""
