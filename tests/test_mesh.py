import jax
import numpy as np
import pytest

from errors import UserInputError
from parallelism.mesh import MeshConfig, build_mesh, device_grid, plan, process_grid


def test_axes_fill_the_node_innermost_first():
  layout = plan(MeshConfig(data=-1, fsdp=2, tensor=2), 8)
  assert layout.sizes == {
    "data": 2,
    "fsdp": 2,
    "expert": 1,
    "context": 1,
    "tensor": 2,
    "pipeline": 1,
  }
  assert layout.nodes == 2 and layout.devices_per_node == 4
  assert layout.nvlink == {
    "data": 1,
    "fsdp": 2,
    "expert": 1,
    "context": 1,
    "tensor": 2,
    "pipeline": 1,
  }
  assert layout.infiniband == {
    "data": 2,
    "fsdp": 1,
    "expert": 1,
    "context": 1,
    "tensor": 1,
    "pipeline": 1,
  }


def test_an_axis_can_span_both_networks():
  layout = plan(MeshConfig(data=1, fsdp=8, tensor=1), 8)
  assert (layout.nvlink["fsdp"], layout.infiniband["fsdp"]) == (4, 2)


def test_mesh_places_data_across_emulated_nodes():
  layout = plan(MeshConfig(data=2, fsdp=2, tensor=2), 8)
  mesh = build_mesh(layout)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  node = ids // layout.devices_per_node
  # Moving along data changes node; moving along fsdp or tensor stays inside one.
  assert (node[0] == 0).all() and (node[1] == 1).all()
  assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor", "pipeline")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_a_replica_fills_its_nodes_innermost_axes_first():
  # Nodes of 4, NVLink domains of two nodes (an NVL72 rack's trays in small): expert 4 x
  # tensor 2 is one domain's 8 devices. Numbered with pipeline the fastest node axis, a
  # domain held both pipeline stages of half of each expert group, whose all-to-alls then
  # crossed InfiniBand.
  layout = plan(
    MeshConfig(data=2, expert=4, tensor=2, pipeline=2, devices_per_node=4, nvlink_domain=8), 32
  )
  assert (layout.infiniband["expert"], layout.infiniband["pipeline"]) == (2, 2)
  ids = device_grid(layout, list(range(32)))  # [data, fsdp, expert, context, tensor, pipeline]
  domain = ids.astype(int) // 8
  for d, p in np.ndindex(2, 2):
    assert len(np.unique(domain[d, :, :, :, :, p])) == 1  # an expert x tensor group
  # A model replica (all but data) on consecutive devices, pipeline its outermost axis.
  assert (np.sort(ids[0].ravel()) == np.arange(16)).all()
  assert (domain[0, ..., 0] == 0).all() and (domain[0, ..., 1] == 1).all()

  # A multi-process run, each process a node, numbers them the same way.
  class Device:
    def __init__(self, i):
      self.id, self.process_index = i, i // 4
      self.device_kind, self.platform = "fake", "cpu"

  devices = [Device(i) for i in range(32)]
  assert (np.vectorize(lambda d: d.id)(process_grid(layout, devices)) == ids).all()


def test_nvl72_domain_allows_tensor_across_nodes():
  layout = plan(MeshConfig(data=1, fsdp=1, tensor=8, devices_per_node=4, nvlink_domain=8), 8)
  assert layout.sizes["tensor"] == 8 and layout.infiniband["tensor"] == 2


@pytest.mark.parametrize(
  "cfg, devices, message",
  [
    (MeshConfig(data=3, fsdp=1, tensor=1), 8, "must equal the 8 devices"),
    (MeshConfig(data=-1, fsdp=-1), 8, "only one axis may be -1"),
    (MeshConfig(data=-1, fsdp=3), 8, "do not divide"),
    (
      MeshConfig(data=1, fsdp=1, tensor=8),
      8,
      "mesh.tensor 8 does not fit in the NVLink domain of 4",
    ),
    (MeshConfig(data=0), 8, "mesh.data must be a positive integer"),
    (MeshConfig(devices_per_node=3), 8, "mesh.devices_per_node must divide"),
  ],
)
def test_bad_meshes_are_refused_with_the_field(cfg, devices, message):
  with pytest.raises(UserInputError, match=message):
    plan(cfg, devices)


def test_tensor_beyond_nvlink_when_asked():
  layout = plan(MeshConfig(data=1, fsdp=1, tensor=8, allow_tensor_beyond_nvlink=True), 8)
  assert layout.infiniband["tensor"] == 2
