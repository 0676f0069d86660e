"""Engine core: no torch here. Backend and Drafter protocols, scheduler, verifier, sampling, statistics."""
