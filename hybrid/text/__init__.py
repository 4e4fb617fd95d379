"""Text in and out: the tokenizers, chat templates, the streaming detokenizer."""
