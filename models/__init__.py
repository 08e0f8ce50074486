"""Pure Flax NNX model code: layers name their array axes and contain no parallelism."""

from flax import nnx

from jaxpar.models.llama import Llama

# jaxpar places parameters itself (jit out_shardings from jaxpar.mesh, which replicates
# a dimension the mesh does not divide); Flax's eager placement would need a mesh at
# every construction and apply its own rules, so it is off.
nnx.use_eager_sharding(False)

__all__ = ["Llama"]
