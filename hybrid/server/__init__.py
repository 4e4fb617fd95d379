"""hybrid serve: an OpenAI-compatible HTTP server (Starlette + uvicorn, SSE) over hybrid.generate, with one
generation slot behind a fair queue, prompt caching between requests, tool calls, reasoning and a chat page."""
