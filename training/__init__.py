"""Drafter training: self-distillation data, EAGLE-3 and DFlash heads, the training loop (`spekula train-drafter`)."""
