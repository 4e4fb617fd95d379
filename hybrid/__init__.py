"""hybrid: run GGUF language models split between GPU and CPU, llama.cpp style."""

__version__ = "0.1.0"
