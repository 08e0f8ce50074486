"""Device meshes and the rules that map a model's logical axis names onto them."""

from jaxpar.mesh.build import AXES, build_mesh, resolve_axis_sizes
from jaxpar.mesh.execution import ExecutionOptions, PipelineOptions, current_execution_options, execution_options
from jaxpar.mesh.rules import PRESETS, resolve_rules
from jaxpar.mesh.shard_map import current_rules, logical_shard_map, mesh_axes, num_shards
from jaxpar.mesh.sharding import constrain, logical_to_sharding, logical_to_spec, state_shardings

__all__ = ["AXES", "build_mesh", "resolve_axis_sizes", "ExecutionOptions", "PipelineOptions", "current_execution_options",
           "execution_options", "PRESETS", "resolve_rules",
           "logical_to_spec", "logical_to_sharding", "state_shardings", "constrain",
           "current_rules", "logical_shard_map", "mesh_axes", "num_shards"]
