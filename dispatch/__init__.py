"""Token movement for expert parallelism: topology, layout, permutation, all-to-all backends."""

from dispatch.dispatcher import PAYLOADS, EPDispatcher, EPHandle, RecvInfo
from dispatch.hopgroups import HopGroups, make_hop_groups
from dispatch.layout import DispatchLayout, check_routing, expert_owner, get_dispatch_layout
from dispatch.permute import Permutation, make_permutation, permute, unpermute
from dispatch.topology import BACKENDS, Topology, make_topology
from dispatch.traffic import Traffic

__all__ = [
    "BACKENDS", "PAYLOADS", "DispatchLayout", "EPDispatcher", "EPHandle", "HopGroups", "Permutation", "RecvInfo",
    "Topology", "Traffic", "check_routing", "expert_owner", "get_dispatch_layout", "make_hop_groups",
    "make_permutation", "make_topology", "permute", "unpermute",
]
