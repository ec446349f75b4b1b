"""Hugging Face interchange: DeepSeek-V3 folders (config.json, safetensors shards) written from checkpoints and read
to start runs (names: the tensor name map, config: the config mapping and refusals, export, load)."""
