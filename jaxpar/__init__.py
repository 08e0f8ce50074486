"""jaxpar: train and serve large language models on device meshes with JAX/XLA."""
