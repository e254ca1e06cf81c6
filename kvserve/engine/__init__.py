"""The engine front: LLM / AsyncEngine, tokenizer, detokenizer, output streams."""
