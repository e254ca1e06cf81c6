"""CPU unit tests: fast, no GPU, no network."""
