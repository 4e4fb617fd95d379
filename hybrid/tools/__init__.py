"""The library halves of the bench, perplexity, info and synthetic-model commands."""
