"""Text in and out of token ids: the tokenizer and incremental detokenizer, the checkpoint's
chat template, and stop strings. Used by the front (and by the in-process LLMEngine, which
detokenizes itself)."""
