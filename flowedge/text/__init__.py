"""The text room, below the engine: tokenizer loading, prompts to token ids (the chat template and its
checks), and an answer's ids back to text with its stop strings. Drivers (nodes, `flowedge generate`, the
benchmarks, the planner) import it; it imports only the errors (and transformers, when a tokenizer loads)."""
