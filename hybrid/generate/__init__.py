"""Generation over an engine: sampling, the single-request loop, timings, chat sessions."""
