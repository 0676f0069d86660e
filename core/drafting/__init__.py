"""The drafter side of the core: the Drafter protocol, the entry-point registry, per-slot drafter state, and the typed interfaces of model-drafter runtimes."""
