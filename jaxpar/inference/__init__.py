"""Generation: a continuous-batching engine over a paged KV cache, speculative decoding,
and an OpenAI-compatible server, on the same model, mesh and checkpoints as training."""

from jaxpar.inference.engine import Engine
from jaxpar.inference.requests import Completion, TokenEvent
from jaxpar.inference.sampling import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams", "TokenEvent"]
