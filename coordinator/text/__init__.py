"""From a request's text to token ids: the tokenizer, the chat template, prompts with pictures."""
