"""The model: weights as views of the GGUF, the architecture table and blocks, the one forward pass, model files."""
