"""Model description: config, RoPE tables, weights and tokenizer of a Hugging Face checkpoint directory, the
Executor protocol and the forward written against it."""
