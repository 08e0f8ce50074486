"""Mesh building, rule presets, and the one place logical names become shardings."""

import logging

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.config import MeshConfig
from jaxpar.mesh import build_mesh, logical_to_spec, resolve_axis_sizes, resolve_rules
from jaxpar.mesh.rules import sequence_parallel_rules, unused_mesh_axes


def test_mesh_has_every_axis_and_fills_minus_one():
  mesh = build_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
  assert mesh.axis_names == ("data", "stage", "fsdp", "context", "expert", "tensor")
  assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_wrong_device_count_is_a_clear_error():
  with pytest.raises(ValueError, match="mesh data=2 x fsdp=3 needs 6 devices but 8 are available") as error:
    build_mesh(MeshConfig(data=2, fsdp=3))
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in str(error.value)  # the CPU host's way to more
  with pytest.raises(ValueError, match="mesh data=3 needs a multiple of 3 devices but 8 are available"):
    resolve_axis_sizes({"data": 3, "fsdp": -1}, 8)


@pytest.mark.tpu
def test_multi_slice_mesh_puts_dcn_axis_across_slices():
  topologies = pytest.importorskip("jax.experimental.topologies")
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=2).devices
  mesh = build_mesh(MeshConfig(data=2, fsdp=4, num_slices=2), devices=devices)
  grid = mesh.devices.reshape(2, 4)
  # data (the DCN axis) crosses slices; fsdp stays inside one slice's ICI.
  assert [{d.slice_index for d in row} for row in grid] == [{0}, {1}]
  with pytest.raises(ValueError, match="mesh.data=1 must be a multiple of mesh.num_slices=2"):
    build_mesh(MeshConfig(data=1, fsdp=8, num_slices=2), devices=devices)


def test_presets_and_unused_axes():
  assert dict(resolve_rules("fsdp"))["embed"] == ("fsdp", "expert", "context")  # expert: more FSDP outside experts; context replicas share weights
  assert dict(resolve_rules("dp"))["embed"] == ()
  assert dict(resolve_rules("tp"))["mlp"] == ("tensor",)
  assert unused_mesh_axes(resolve_rules("fsdp"), {"fsdp": 4, "tensor": 2}) == ["tensor"]
  assert unused_mesh_axes(resolve_rules("fsdp_tp"), {"fsdp": 4, "tensor": 2}) == []
  with pytest.raises(ValueError, match="mesh.rules='zero9' is not a preset"):
    resolve_rules("zero9")


def test_logical_to_spec_maps_and_falls_back(caplog):
  mesh = build_mesh(MeshConfig(fsdp=4, tensor=2))
  rules = resolve_rules("fsdp_tp")
  assert logical_to_spec(("embed", "mlp"), (64, 128), mesh, rules) == P("fsdp", "tensor")
  assert logical_to_spec(("batch", "length"), (8, 16), mesh, rules) == P("fsdp", None)
  with caplog.at_level(logging.WARNING):
    spec = logical_to_spec(("embed", "mlp"), (6, 128), mesh, rules)
  assert spec == P(None, "tensor")
  assert "replicating logical axis 'embed' (size 6)" in caplog.text
  with pytest.raises(ValueError, match="logical axis 'nonsense' has no rule"):
    logical_to_spec(("nonsense",), (8,), mesh, rules)


def test_expert_axis_splits_experts_and_tokens_in_every_preset():
  mesh = build_mesh(MeshConfig(expert=2, fsdp=2, tensor=2))
  for preset in ("dp", "fsdp", "tp", "fsdp_tp"):
    rules = resolve_rules(preset)
    assert logical_to_spec(("batch", "length"), (8, 16), mesh, rules)[0] == ("fsdp", "expert")
    assert logical_to_spec(("experts", "embed", "mlp"), (8, 64, 128), mesh, rules)[0] == "expert"
  rules = resolve_rules("fsdp_tp")
  # Expert weights: experts over expert, embed over what is left of FSDP, mlp over tensor.
  assert logical_to_spec(("experts", "embed", "mlp"), (8, 64, 128), mesh, rules) == P("expert", "fsdp", "tensor")
  assert logical_to_spec(("embed", "mlp"), (64, 128), mesh, rules) == P(("fsdp", "expert"), "tensor")


def test_sequence_parallel_splits_the_residual_stream_over_tensor_too():
  rules = resolve_rules("fsdp_tp")
  assert dict(rules)["residual_length"] == dict(rules)["length"] == ("context",)
  assert dict(sequence_parallel_rules(rules))["residual_length"] == ("context", "tensor")
  # An explicit list written without it splits the residual stream like `length`.
  assert dict(resolve_rules([["length", "context"]]))["residual_length"] == ("context",)


def test_explicit_rules_from_config():
  rules = resolve_rules([["embed", ["fsdp", "data"]], ["mlp", None]])
  assert dict(rules) == {"embed": ("fsdp", "data"), "mlp": ()}
