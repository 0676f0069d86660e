"""How long drafts are: the fixed lengths llama.cpp uses and the adaptive policy with its cost model, acceptance and confidence estimates."""
