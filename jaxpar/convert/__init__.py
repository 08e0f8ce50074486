"""Checkpoints in other forms: Hugging Face import/export and post-training quantization."""
