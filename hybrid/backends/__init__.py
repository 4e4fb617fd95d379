"""The backends that run a layer's ops (one Protocol): CPU (fused layers, repacked weights), GPU, op offload."""
